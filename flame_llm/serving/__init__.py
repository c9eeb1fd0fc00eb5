"""Serving: the Python client, its shard channels and what it knows of its shards (shard_watch), the service
(router + engine actors on Ray), its config, and the standalone engine over HTTP."""
