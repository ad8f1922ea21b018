"""The chaos test on 3 pipeline shards over a local 3-node Valkey Cluster (`kvrelay up --shards
3`): workers, the store and a random cluster node SIGKILLed while chat requests stream, every
request ending exactly as it did undisturbed (tests/e2e/test_chaos.py has the schedule).
A manual run with KVRELAY_CHAOS_REPLICAS=N: `up --shards 3 --valkey-replicas N`, the Valkey
victim the node serving a random shard now (its replica is promoted by the cluster)."""

from __future__ import annotations

from collections.abc import Sequence
from unittest.mock import patch

import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_chaos import CHAOS_ENV, REPLICAS, churn_and_compare

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    extra = ["--valkey-replicas", str(REPLICAS)] if REPLICAS else []
    s = Stack(
        tmp_path_factory.mktemp("chaos-shards"),
        prefill=2,
        decode=2,
        shards=3,
        env=CHAOS_ENV,
        extra=extra,
    )
    s.up(timeout=300)
    yield s
    s.down()


class ShardPrimaries(Sequence):
    """The programs serving each shard's slots, asked at each pick (`rng.choice`): after a
    failover a shard's primary is the promoted replica."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.slots = [n["first_slot"] for n in stack.state["cluster"]["nodes"][: stack.shards]]

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i):
        return self.stack.serving(self.slots[i])


def test_no_request_lost_under_churn_on_a_sharded_cluster(stack):
    assert stack.valkeys == ("valkey-0", "valkey-1", "valkey-2")
    if REPLICAS:
        with patch.object(Stack, "valkeys", ShardPrimaries(stack)):
            churn_and_compare(stack)
    else:
        churn_and_compare(stack)
