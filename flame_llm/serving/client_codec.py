"""The client's use of the one wire codec (flame_llm/protocol/wire.py): request payloads encoded for the service's
model revision and zstd level, result payloads decoded, their sizes and times added to the client's counters.
Batches (batch_send.py) and streams (client_stream.py) alike."""
from __future__ import annotations

import dataclasses
import time

from flame_llm.protocol.types import Result
from flame_llm.protocol.wire import decode_results, decoded_size, encode_requests
from flame_llm.serving.batcher import ClientCounters, Pending, attempt_id


class ClientCodec:
    def __init__(self, model_revision: str, zstd_level: int, counters: ClientCounters) -> None:
        self.model_revision, self.zstd_level, self.counters = model_revision, zstd_level, counters

    def encode(self, batch: list[Pending]) -> bytes:
        """The batch's payload; a request sent again goes under its attempt's id (batcher.attempt_id)."""
        t0 = time.perf_counter()
        reqs = [p.request if not p.attempts else dataclasses.replace(p.request, id=attempt_id(p)) for p in batch]
        payload = encode_requests(reqs, self.model_revision, self.zstd_level)
        c = self.counters
        c.encode_s += time.perf_counter() - t0
        c.payload_wire_bytes += len(payload)
        c.payload_raw_bytes += decoded_size(payload)  # the msgpack size, from the header
        return payload

    def decode(self, reply: bytes) -> list[Result]:
        t0 = time.perf_counter()
        results = decode_results(reply)
        self.counters.result_decode_s += time.perf_counter() - t0
        self.counters.result_payloads += 1
        return results
