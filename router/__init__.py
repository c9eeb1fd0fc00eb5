"""The prefix router: a pure policy (router.policy) and the named Ray actor around it (router.actor)."""
from router.policy import POLICIES, RouterPolicy

__all__ = ["POLICIES", "RouterPolicy"]
