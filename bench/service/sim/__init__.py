"""Router simulation without a model (issue 42): engine shards with the real BlockManager and Scheduler and a
step-time model instead of kernels, routers as the service runs them, in one process in simulated time."""
