"""bench.service.stream_flood's standalone target: a StreamServer on loopback with stand-in streams (payload b"N": N
one-token chunks, then b"result"), printing its endpoint as one JSON line, serving until terminated (at most
`max_s`). argv[1]: JSON of the flood's arguments (hello_timeout_s, accept_share, defer_accept; optional nofile, a
descriptor limit to set)."""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
from dataclasses import asdict

from actors.shard_options import ShardOptions
from actors.stream_server import StreamServer


async def items(payload: bytes, caller, client, owner=None):
    for i in range(int(payload)):
        yield [i]
    yield b"result"


async def serve(args: dict) -> None:
    over = {k: args[a] for k, a in (("stream_accept_share", "accept_share"), ("stream_defer_accept", "defer_accept"),
                                                ("stream_refuse_reset", "refuse_reset"))
            if a in args}
    limits = ShardOptions(stream_hello_timeout_s=args.get("hello_timeout_s", 5.0), **over).stream_limits()
    server = StreamServer(items, 1 << 16, "flood", "standalone", limits)
    ep = await server.start("127.0.0.1")
    print(json.dumps(asdict(ep)), flush=True)
    try:
        await asyncio.sleep(args.get("max_s", 300.0))
    finally:
        logging.getLogger(__name__).warning("counters %s", json.dumps(server.counters))
        await server.stop()


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if a.get("nofile"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (a["nofile"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    asyncio.run(serve(a))
