"""Issue 42, router scale-out on real Ray: `router.replicas` router actors share the prefix space by consistent
hashing on the prompt's first routing block (router/replicas.py); the client's RouterReplicas
(router/replica_client.py) routes each request to its replica, fails over to the next one on the ring when a
replica dies mid-stream, and the service's supervisor revives it."""

import random

import pytest

from flame_llm.protocol.routing_key import prefix_chain
from flame_llm.serving.service_config import ServiceConfig
from router.policy import RouterConfig
from router.replicas import VNODES, ReplicaRing


def test_replicas_field_defaults_to_one_and_names_itself_when_wrong():
    assert RouterConfig().replicas == 1 and ServiceConfig().router.replicas == 1
    assert ServiceConfig.from_kwargs(replicas=3).router.replicas == 3
    for bad in (0, -1, 65, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"router field 'replicas' must be an integer in \[1, 64\]"):
            RouterConfig(replicas=bad)


def test_ring_has_256_points_per_replica_and_maps_a_prompt_by_its_first_block():
    ring = ReplicaRing(3)
    assert VNODES == 256 and len(ring._keys) == 3 * 256
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(30_000)]
    assert all(9_000 < n < 11_000 for n in ring.shares(keys).values())  # near even
    doc = list(range(3, 600))
    a, b = prefix_chain(doc + [1, 2, 3], "rev"), prefix_chain(doc[:300] + [9] * 300, "rev")
    assert a[0] == b[0] and a[1:] != b[1:]  # same first routing block, different later blocks
    assert ring.owner_of(a) == ring.owner_of(b) == ring.owner(a[0])
    assert ReplicaRing(1).owner_of(a) == 0
