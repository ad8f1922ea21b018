"""Submissions to a replicated Valkey are acknowledged only once a replica holds them (issue 48).

A Valkey Cluster of 3 primaries with a replica each (real valkey-server nodes, formed as
`kvrelay up --shards 3 --valkey-replicas 1` forms it): a submission WAITs on the primary of
its hash slot, so the replica holds the record and the stream entry when it is acknowledged;
with that replica stopped (SIGSTOP: WAIT reports 0 acknowledgments, the primary buffers the
writes) it is a 503 not_replicated, and so is a reattaching retry (`confirm_replicated`), until
the replica is back: then the retry is acknowledged and the request is queued once. A cluster
without replicas does not wait. A Sentinel-replicated Valkey's reattaching retry waits too.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from kvrelay.cli.up.valkey import free_ports
from kvrelay.cli.up.valkey_cluster import (
    NODE_TIMEOUT_MS,
    ClusterNode,
    NodeLine,
    cluster_nodes,
    form,
    make_nodes,
    myself,
    serving_port,
    valkey_command,
)
from kvrelay.core.keys import Keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.queue.choices_state import choice_id
from kvrelay.pipeline.queue.redis_options import async_redis, cluster_has_replicas
from kvrelay.pipeline.queue.submit import Producer
from tests.pipeline.ingress_support import MODEL, unique_prefix
from tests.sentinel_group import SentinelGroup

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ACK_MS = 300  # the submissions' WAIT here: a stopped replica costs 300 ms per try


class Nodes:
    """The cluster's node processes, by name (`valkey-<i>`, `valkey-<i>-replica-0`)."""

    def __init__(self, root: Path):
        ports = free_ports(12, set())
        self.nodes = make_nodes(root, ports[:6], ports[6:], None, 1)
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> None:
        for node in self.nodes:
            Path(node.data_dir).mkdir(parents=True, exist_ok=True)
            cmd = valkey_command(node.port, node.data_dir, node.bus_port, NODE_TIMEOUT_MS)
            self.procs[node.name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        assert form(self.nodes, timeout_s=30) is True
        for node in self.nodes[3:]:
            self.wait(lambda n=node: self.link_up(n), f"{node.name} replicating")

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if name in self.stopped:
                proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=10)

    def client(self, node: ClusterNode) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=5)

    def link_up(self, node: ClusterNode) -> bool:
        client = self.client(node)
        try:
            return client.info("replication").get("master_link_status") == "up"
        finally:
            client.close()

    def wait(self, ok, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
            time.sleep(0.05)

    def serving(self, key: str) -> tuple[ClusterNode, ClusterNode]:
        """(the primary serving `key`'s slot, its replica), as the cluster says now."""
        seed = self.client(self.nodes[0])
        try:
            port = serving_port(seed, key_slot(key.encode()))
            assert port is not None
            by_port = {n.port: n for n in self.nodes}
            primary = by_port[port]
            lines = cluster_nodes(seed)
            primary_id = next(line.id for line in lines if line.port == port)
            replica = next(by_port[line.port] for line in lines if line.primary_id == primary_id)
            return primary, replica
        finally:
            seed.close()

    def pause(self, node: ClusterNode) -> None:
        self.procs[node.name].send_signal(signal.SIGSTOP)
        self.stopped.add(node.name)

    def resume(self, node: ClusterNode) -> None:
        self.procs[node.name].send_signal(signal.SIGCONT)
        self.stopped.discard(node.name)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[Nodes]:
    cluster = Nodes(tmp_path_factory.mktemp("cluster-wait"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def readonly(nodes: Nodes, node: ClusterNode) -> redis.Redis:
    """A plain client of `node` that reads a replica's keys (READONLY: no MOVED)."""
    client = nodes.client(node)
    client.execute_command("READONLY")
    return client


def held(client: redis.Redis, keys: Keys, request_id: str) -> tuple[object, int]:
    """(the status req:{id} holds on that node, the entries of its shard's work streams)."""
    shard = keys.of(request_id)
    status = client.hget(shard.request(request_id), "status")
    return status, client.xlen(shard.prefill_stream) + client.xlen(shard.decode_stream)


def refused(exc: pytest.ExceptionInfo[RequestError]) -> tuple[int, str | None, dict[str, str]]:
    return exc.value.status, exc.value.code, exc.value.headers


NO_LINE = NodeLine("", 0, [], "-", [])
NOT_REPLICATED = (503, "not_replicated", {"Retry-After": "1"})


def _producer(client: AsyncClient, ack_ms: int = ACK_MS) -> Producer:
    return Producer(
        client.redis,
        client.keys,
        client.registry,
        client.producer.router,
        replica_ack_timeout_ms=ack_ms,
    )


def _client(url: str, prefix: str, tokenizer) -> AsyncClient:
    return AsyncClient(url, key_prefix=prefix, tokenizers={MODEL: tokenizer}, shards=3)


async def test_a_submission_is_acknowledged_once_the_slots_replica_holds_it(
    nodes, smollm_tokenizer
):
    prefix = unique_prefix()
    async with _client(nodes.url, prefix, smollm_tokenizer) as client:
        assert await cluster_has_replicas(client.redis) is True
        producer = _producer(client)
        sampling = SamplingParams(max_tokens=4)
        task, entry = await producer.prepare(MODEL, sampling, request_id="cw-1", prompt="Hi")
        assert await producer.enqueue(task, entry) is not None
        _, replica = nodes.serving(client.keys.of("cw-1").request("cw-1"))
        # read the replica right at acknowledgment: it holds the record and the entry
        copy = readonly(nodes, replica)
        assert held(copy, client.keys, "cw-1") == (b"queued", 1)

        # the replica stopped: the submission is not acknowledged while it is
        slow = _producer(client, ack_ms=60000)
        task, entry = await slow.prepare(MODEL, sampling, request_id="cw-2", prompt="Hi")
        primary, replica = nodes.serving(client.keys.of("cw-2").request("cw-2"))
        nodes.pause(replica)
        try:
            pending = asyncio.create_task(slow.enqueue(task, entry))
            await asyncio.sleep(0.5)
            assert not pending.done()
            # queued on the primary meanwhile (the record is there, the replica lacks it)
            assert held(nodes.client(primary), client.keys, "cw-2")[0] == b"queued"
        finally:
            nodes.resume(replica)
        assert await asyncio.wait_for(pending, 30) is not None
        copy = readonly(nodes, replica)
        assert held(copy, client.keys, "cw-2")[0] == b"queued"
        copy.close()
        # the WAIT's write: a key under the request's hash tag that expires
        marker = client.keys.of("cw-2").replicated
        assert 0 < client_ttl(nodes, primary, marker) <= 60000


def client_ttl(nodes: Nodes, node: ClusterNode, key: str) -> int:
    client = nodes.client(node)
    try:
        return int(client.pttl(key))
    finally:
        client.close()


async def test_a_stopped_replica_gets_503_and_the_retries_are_acknowledged_once_it_resumes(
    nodes, smollm_tokenizer
):
    prefix = unique_prefix()
    async with _client(nodes.url, prefix, smollm_tokenizer) as client:
        producer = _producer(client)
        rid = "cw-3"
        sampling = SamplingParams(max_tokens=4)
        task, entry = await producer.prepare(MODEL, sampling, request_id=rid, prompt="Hi")
        primary, replica = nodes.serving(client.keys.of(rid).request(rid))
        nodes.pause(replica)
        try:
            with pytest.raises(RequestError) as first:
                await producer.enqueue(task, entry)
            assert refused(first) == NOT_REPLICATED
            assert f"within {ACK_MS} ms" in first.value.message
            # queued on the primary all the same: a retry must find it, not queue it again
            assert held(nodes.client(primary), client.keys, rid) == (b"queued", 1)
            # a client retrying with the same X-Request-Id reattaches without submitting:
            # it waits for the replica too, and is refused as long as none holds the request
            with pytest.raises(RequestError) as reattached:
                await producer.confirm_replicated(rid)
            assert refused(reattached) == NOT_REPLICATED
            # a retry through the submit script (the request exists: nothing queued) too
            with pytest.raises(RequestError) as again:
                await producer.enqueue(task, entry)
            assert refused(again) == NOT_REPLICATED
        finally:
            nodes.resume(replica)
        await producer.confirm_replicated(rid)  # the reattaching retry is acknowledged now
        assert await producer.enqueue(task, entry) is None  # exists: reattached, acknowledged
        copy = readonly(nodes, replica)
        assert held(copy, client.keys, rid) == (b"queued", 1)  # one entry, no duplicate
        copy.close()
        assert held(nodes.client(primary), client.keys, rid) == (b"queued", 1)
        # a request the primary does not hold (lost in a failover) is no acknowledged retry
        with pytest.raises(RequestError) as lost:
            await producer.confirm_replicated("cw-never-queued")
        assert refused(lost) == NOT_REPLICATED


async def test_several_choices_wait_as_one_request(nodes, smollm_tokenizer):
    """n=2: the parent record and both choices' tasks in one script, then one WAIT."""
    async with _client(nodes.url, unique_prefix(), smollm_tokenizer) as client:
        producer = _producer(client)
        rid, sampling = "cw-n", SamplingParams(max_tokens=4)
        tasks = []
        for k in range(2):
            task, entry = await producer.prepare(
                MODEL, sampling, request_id=choice_id(rid, k), prompt="Hi"
            )
            tasks.append(task)
        primary, replica = nodes.serving(client.keys.of(rid).request(rid))
        nodes.pause(replica)
        try:
            with pytest.raises(RequestError) as first:
                await producer.enqueue_choices(rid, tasks, entry)
            assert refused(first) == NOT_REPLICATED
        finally:
            nodes.resume(replica)
        assert await producer.enqueue_choices(rid, tasks, entry) is None  # queued: reattached
        copy = readonly(nodes, replica)
        assert held(copy, client.keys, rid) == (b"queued", 2)  # one entry per choice
        copy.close()


async def test_a_failover_moving_the_slot_is_followed_by_the_wait(nodes, smollm_tokenizer):
    """CLUSTER FAILOVER on the replica: the roles swap, the client's slot map is stale, the
    WAIT's EXISTS gets a MOVED: the slot map is refreshed and the WAIT runs on the new primary
    (its replica: the old primary). Last in the module: it swaps the roles."""
    prefix = unique_prefix()
    async with _client(nodes.url, prefix, smollm_tokenizer) as client:
        producer = _producer(client)
        rid = "cw-4"
        sampling = SamplingParams(max_tokens=4)
        task, entry = await producer.prepare(MODEL, sampling, request_id=rid, prompt="Hi")
        assert await producer.enqueue(task, entry) is not None
        primary, replica = nodes.serving(client.keys.of(rid).request(rid))
        promoted = nodes.client(replica)
        promoted.execute_command("CLUSTER", "FAILOVER")
        nodes.wait(lambda: "master" in (myself(promoted) or NO_LINE).flags, "the replica promoted")
        promoted.close()
        nodes.wait(lambda: nodes.link_up(primary), "the old primary replicating")
        key = client.keys.of(rid).request(rid)
        assert client.redis.get_node_from_key(key).port == primary.port  # stale: the old one
        await producer.confirm_replicated(rid)
        assert client.redis.get_node_from_key(key).port == replica.port  # refreshed
        assert nodes.serving(client.keys.of(rid).request(rid)) == (replica, primary)
        assert held(readonly(nodes, primary), client.keys, rid) == (b"queued", 1)


async def test_a_cluster_without_replicas_does_not_wait(shared_cluster, smollm_tokenizer):
    prefix = unique_prefix()
    async with _client(shared_cluster.url, prefix, smollm_tokenizer) as client:
        assert await cluster_has_replicas(client.redis) is False
        producer = _producer(client)
        task, entry = await producer.prepare(
            MODEL, SamplingParams(max_tokens=4), request_id="cw-5", prompt="Hi"
        )
        assert await producer.enqueue(task, entry) is not None
        await producer.confirm_replicated("cw-5")  # at once
        # no WAIT's write: no marker key
        marker = client.keys.of("cw-5").replicated
        assert await client.redis.exists(marker) == 0


async def test_a_reattaching_retry_waits_for_a_sentinel_replica(tmp_path, smollm_tokenizer):
    group = SentinelGroup(tmp_path, replicas=1)
    group.start()
    redis_client = async_redis(group.url, 16)
    try:
        keys = Keys(unique_prefix())
        async with AsyncClient(
            group.url, key_prefix=keys.prefix, tokenizers={MODEL: smollm_tokenizer},
            redis=redis_client,
        ) as client:  # fmt: skip
            producer = _producer(client)
            rid = "cw-s"
            task, entry = await producer.prepare(
                MODEL, SamplingParams(max_tokens=4), request_id=rid, prompt="Hi"
            )
            group.signal("node-1", signal.SIGSTOP)
            try:
                with pytest.raises(RequestError) as first:
                    await producer.enqueue(task, entry)
                assert refused(first) == NOT_REPLICATED
                with pytest.raises(RequestError) as reattached:
                    await producer.confirm_replicated(rid)
                assert refused(reattached) == NOT_REPLICATED
            finally:
                group.signal("node-1", signal.SIGCONT)
            await producer.confirm_replicated(rid)
            assert await producer.enqueue(task, entry) is None
            replica = group.client(1)
            assert held(replica, keys, rid) == (b"queued", 1)
            replica.close()
    finally:
        await redis_client.aclose()
        group.stop()
