"""The protocol between client, router, actors, HTTP and bench: `types` (requests, results, error codes, the
limits engines publish, the checks at entry), `checks` (the value checks they share), `wire` (the zstd+msgpack
codec), `routing_key` (prompt-prefix identity, work estimates and the router's records)."""
