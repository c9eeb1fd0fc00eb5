"""The prefix router: a pure policy (router.policy) and the named Ray actor around it (router.actor). Nothing is
imported here, so the client, which needs only router.replicas, imports no policy."""
