"""The chaos test on 3 pipeline shards over a local 3-node Valkey Cluster (`kvrelay up --shards
3`): workers, the store and a random cluster node SIGKILLed while chat requests stream, every
request ending exactly as it did undisturbed (tests/e2e/test_chaos.py has the schedule)."""

from __future__ import annotations

import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_chaos import CHAOS_ENV, churn_and_compare

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("chaos-shards"), prefill=2, decode=2, shards=3, env=CHAOS_ENV)
    s.up(timeout=300)
    yield s
    s.down()


def test_no_request_lost_under_churn_on_a_sharded_cluster(stack):
    assert stack.valkeys == ("valkey-0", "valkey-1", "valkey-2")
    churn_and_compare(stack)
