"""A stream's token chunks as its reader takes them: what the engine emitted while the reader was away (the last
chunk in transit, or its loop busy) leaves as one chunk, so a slow reader gets fewer, larger objects rather than
falling behind one object per step. AsyncEngine.stream_chunks and the engine actor's streams read through it."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def coalesced(chunks: asyncio.Queue) -> AsyncIterator[list[int]]:
    """The token lists put on `chunks`, each with whatever queued behind it joined on; ends at a None."""
    while (chunk := await chunks.get()) is not None:
        while not chunks.empty():
            more = chunks.get_nowait()
            if more is None:
                yield chunk
                return
            chunk = chunk + more
        yield chunk
