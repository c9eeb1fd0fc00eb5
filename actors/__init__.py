"""Per-GPU Ray engine actors: pinning by GPU UUID, the engine session, the async admission loop."""
