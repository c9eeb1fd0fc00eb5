"""The service path: where a request's time and bytes go (hops, results, hand-off), streams (CPU per token, a
connection flood), routing (its cost, the router simulation in sim/) and the soak."""
