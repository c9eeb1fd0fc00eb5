"""What a shard's channel (channel.py) takes from the Dispatcher that owns it (dispatch.py): the client's parts that
every shard shares, named here so that the channel does not import the dispatcher."""
from __future__ import annotations

from typing import Protocol

import ray

from flame_llm.protocol.types import EngineLimits
from flame_llm.serving.client_config import ClientConfig
from flame_llm.serving.pending import ClientCodec, ClientCounters, Pending
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardWatch


class ChannelOwner(Protocol):
    config: ClientConfig
    limits: EngineLimits  # what every shard accepts
    counters: ClientCounters
    codec: ClientCodec
    actors: dict[int, ray.actor.ActorHandle]  # shard -> its actor now (ShardWatch puts a replacement's here)
    caller: str  # this client's Ray job; with client_id: its turn in the shards' fair admission
    client_id: str
    shards: ShardWatch
    routing: ClientRouting

    async def route_again(self, ps: list[Pending]) -> None:
        """Requests sent again: routed anew."""
