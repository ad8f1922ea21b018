"""Network faults on the store links (issue 48 item 3): pages fetched across a delayed, lossy
link and across a link cut mid-fetch.

Two "hosts", each a network namespace: host P runs a prefill worker and its store node, host D
a decode worker and its store node (workers talk to their own host's node over its IPC socket;
only store nodes talk to each other). Three `tests.netlink.Link`s, each a user-space netem:
`lp` (ours <-> P) and `ld` (ours <-> D) carry the workers' and the store nodes' Valkey traffic
(Valkey runs here), `lpd` (P <-> D) the store-to-store page transfers: D's node fetches the
pages P's prefill put, over TCP. Requests go through the producer client (Redis only, here) in
disaggregated mode, so every prompt is computed by P and its pages fetched by D; each run uses
its own `cache_salt`, so its pages are new to both nodes. Greedy decoding makes every run's
text comparable with an undisturbed one. Real components only: valkey-server, `kvrelay store`
and `kvrelay worker` processes, the SmolLM2 model. Skipped (with the reason) where network
namespaces or TUN devices are unavailable.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import redis

from kvrelay.core.keys import Keys
from kvrelay.kvstore.client import StoreClient
from kvrelay.pipeline.client.producer import Client
from tests.conftest import ValkeyServer
from tests.netlink import (
    Link,
    LoggedProcess,
    add_netns,
    del_netns,
    on_port,
    require_netns,
    wait_until,
)

MODEL = "smollm2-135m-instruct"
KEYS = Keys("kvrelay:")
SAMPLING = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPTS = [  # 50-70 tokens each: three or four full pages to fetch
    "The history of the lighthouse on the rocky island begins with a shipwreck in the winter "
    "of 1851, when a merchant vessel carrying wool and tea ran aground in a storm. The "
    "villagers rowed out through the waves and saved the crew, and the next spring",
    "Three reasons to learn to play the piano are that it trains both hands to work apart, "
    "that it teaches you to read music in two clefs at once, and that it lets you accompany "
    "singers and other instruments. A fourth reason, which teachers often forget, is",
    "Once upon a time, in a village by the sea, there lived an old fisherman and his "
    "granddaughter. Every morning they pushed their small blue boat into the water before "
    "sunrise and every evening they sold their catch at the market square, until one day",
]
SECRET = "net-faults"
STORE_LOG = re.compile(r"^(\S+ \S+) WARNING kvrelay\.kvstore\.remote: fetch of (\d+) pages")


class Proc(LoggedProcess):
    """A `kvrelay` child process inside a namespace, its output in a log file."""

    def __init__(self, name: str, ns: str, args: list[str], tmp: Path):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvrelay.cli.main", *args]
        super().__init__(name, cmd, tmp / f"{name}.log")


class Hosts:
    """Valkey here; hosts P and D (a store node and a worker each); the three links."""

    def __init__(self, tmp: Path, lp: Link, ld: Link, lpd: Link):
        self.lp, self.ld, self.lpd, self.tmp = lp, ld, lpd, tmp
        self.procs: list[Proc] = []
        self.valkey = ValkeyServer(tmp / "valkey", extra_binds=(lp.ours, ld.ours))
        self.valkey.start()
        self.r = redis.Redis.from_url(self.valkey.url)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self.client = Client(self.valkey.url, model=MODEL, mode="disaggregated")

    def _start(self) -> None:
        port, tmp = self.valkey.port, self.tmp
        # (host, namespace, its link to Valkey, its address on the store link)
        hosts = [("p", self.lp, self.lpd.ours), ("d", self.ld, self.lpd.theirs)]
        for host, link, store_addr in hosts:
            ns = link.ns
            url = f"redis://{link.ours}:{port}/0"
            run_dir = str(tmp / f"store-{host}")
            self.procs.append(Proc(f"store-{host}", ns, [
                "store", "--node-id", f"host{host}", "--run-dir", run_dir, "--redis-url", url,
                "--model", MODEL, "--arena-bytes", str(160 << 20), "--listen-host", store_addr,
                "--tcp-port", "0", "--ucx-port", "-1", "--transport", "tcp",
                "--secret", SECRET, "--keep-arena", "false"], tmp))  # fmt: skip
            role = "prefill" if host == "p" else "decode"
            self.procs.append(Proc(role, ns, [
                "worker", role, "--name", f"net-{role}", "--redis-url", url, "--model", MODEL,
                "--threads", "1", "--kv-cache-bytes", str(96 << 20), "--metrics-port", "-1",
                "--slot-dir", str(tmp / f"slots-{host}"), "--speculation", "off",
                "--store-run-dir", run_dir], tmp))  # fmt: skip
        self.stores = {h: StoreClient(self.tmp / f"store-{h}", timeout_s=30) for h in "pd"}
        for w in ("net-prefill", "net-decode"):
            wait_until(f"worker {w} did not start",
                  lambda w=w: self.r.hget(KEYS.worker(w), "consumer") is not None,
                  240, self.logs)  # fmt: skip
        self.p_port = int(self.stats("p")["addresses"]["tcp"].rsplit(":", 1)[1])

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def stats(self, host: str) -> dict:
        return self.stores[host].stats()

    def counters(self, host: str) -> dict[str, dict[str, float]]:
        return self.stats(host)["counters"]

    def logs(self) -> str:
        return "".join(f"\n== {p.name}\n{p.text()[-2500:]}" for p in self.procs)

    def netem(self, delay_s: float = 0.0, loss: float = 0.0) -> None:
        for link in (self.lp, self.ld, self.lpd):
            link.netem(delay_s, loss)

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for store in getattr(self, "stores", {}).values():
            store.close()
        for p in reversed(self.procs):
            p.stop()
        self.valkey.stop()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[Hosts]:
    require_netns()
    tag = f"{os.getpid() % 100000}"
    p_ns, d_ns = f"kvp{tag}", f"kvd{tag}"
    links: list[Link] = []
    made: list[str] = []
    hosts = None
    try:
        for ns in (p_ns, d_ns):
            add_netns(ns)
            made.append(ns)
        links = [Link("p", 235, far=p_ns, seed=59), Link("d", 236, far=d_ns, seed=61),
                 Link("x", 237, near=p_ns, far=d_ns, seed=67)]  # fmt: skip
        try:
            for link in links:
                link.create()
        except OSError as exc:  # TUNSETIFF refused (no CAP_NET_ADMIN in a container)
            pytest.skip(f"cannot create TUN devices here: {exc}")
        hosts = Hosts(tmp_path_factory.mktemp("storenet"), *links)
        yield hosts
    finally:
        if hosts is not None:
            hosts.close()
        for link in links:
            if link.thread.is_alive():
                link.destroy()
        for ns in made:
            del_netns(ns)


def _stream(hosts: Hosts, request_id: str) -> tuple[str, list[int], str | None]:
    text, tokens, reason = "", [], None
    for chunk in hosts.client.stream(request_id):
        assert chunk.index == len(tokens), f"{request_id}: chunk at {chunk.index}, {len(tokens)}"
        text += chunk.text
        tokens.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return text, tokens, reason


def _run_all(hosts: Hosts, salt: str, prompts=PROMPTS) -> list[tuple[str, list[int], str | None]]:
    """Every prompt at once (pages salted with `salt`: new to both nodes), read in parallel."""
    ids = [hosts.client.submit(p, sampling=SAMPLING, request_id=f"{salt}-{i}", cache_salt=salt)
           for i, p in enumerate(prompts)]  # fmt: skip
    got: dict[str, tuple] = {}
    errors: list[BaseException] = []

    def read(rid: str) -> None:
        try:
            got[rid] = _stream(hosts, rid)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, f"{errors!r}{hosts.logs()}"
    assert len(got) == len(ids), f"a request did not finish{hosts.logs()}"
    return [got[rid] for rid in ids]


def _delta(before: dict, after: dict, name: str, label: str) -> float:
    return after.get(name, {}).get(label, 0.0) - before.get(name, {}).get(label, 0.0)


REF: dict[str, list] = {}


def _reference(hosts: Hosts) -> list:
    """The undisturbed run (links clear), once per module."""
    if "ref" not in REF:
        before = hosts.counters("d")
        REF["ref"] = _run_all(hosts, "ref")
        fetched = _delta(before, hosts.counters("d"), "hits", "remote")
        print(f"\nundisturbed: D fetched {fetched:.0f} pages from P")
        assert fetched >= 1, f"{hosts.counters('p')} {hosts.counters('d')}{hosts.logs()}"
        assert all(len(t) == SAMPLING["max_tokens"] and r == "length" for _, t, r in REF["ref"])
    return REF["ref"]


def test_every_link_delayed_and_lossy_changes_no_token(hosts):
    ref = _reference(hosts)
    before_d, before_p = hosts.counters("d"), hosts.counters("p")
    dropped = [link.dropped for link in (hosts.lp, hosts.ld, hosts.lpd)]
    hosts.netem(delay_s=0.2, loss=0.05)
    t0 = time.monotonic()
    try:
        got = _run_all(hosts, "netem")
    finally:
        hosts.netem()
    took = time.monotonic() - t0
    after_d, after_p = hosts.counters("d"), hosts.counters("p")
    links = (hosts.lp, hosts.ld, hosts.lpd)
    dropped = [link.dropped - n for link, n in zip(links, dropped, strict=True)]
    print(
        f"\nevery link 200 ms each way + 5% loss: {len(PROMPTS)} requests in {took:.1f}s; "
        f"packets dropped on P-Valkey, D-Valkey, P-D: {dropped}; P put "
        f"{_delta(before_p, after_p, 'puts', 'host'):.0f} pages; D fetched "
        f"{_delta(before_d, after_d, 'hits', 'remote'):.0f} from P, "
        f"{_delta(before_d, after_d, 'transfer_failures', 'tcp'):.0f} fetch(es) failed, "
        f"{_delta(before_d, after_d, 'transfer_skips', 'hostp'):.0f} skipped"
    )
    abandoned = hosts.proc("decode").text().count("took over 5.0s; recomputing")
    print(f"the decode worker gave up waiting (fetch_timeout_s) on {abandoned} fetch(es)")
    assert got == ref
    assert all(n >= 1 for n in dropped[:2])  # the loss was in effect on the Valkey links
    assert _delta(before_p, after_p, "puts", "host") >= len(PROMPTS)  # P prefilled them
    for p in hosts.procs:
        assert p.proc.poll() is None, f"{p.name} exited{hosts.logs()}"


def _fetch_failures(store: Proc, since: float) -> list[tuple[float, int]]:
    """(time.time(), pages) of each failed fetch the store node logged after `since`."""
    out = []
    for line in store.text().splitlines():
        if m := STORE_LOG.match(line):
            at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= since:
                out.append((at, int(m[2])))
    return out


def test_store_link_cut_mid_fetch_recomputes_then_fetches_again(hosts):
    ref = _reference(hosts)
    # a fetch the worker gave up on may still be under way on D's node (the lossy test's):
    # the cut must fall in this test's own fetch
    wait_until("D's node kept fetching", lambda: not hosts.counters("d").get("remote_fetches"),
          30, hosts.logs)  # fmt: skip
    started = time.time()
    before = hosts.counters("d")
    # a fresh session's handshake is ~8 packets: the 21st packet on P's port is a page's
    hosts.lpd.cut_after(20, on_port(hosts.p_port))
    try:
        got = _run_all(hosts, "cut", PROMPTS[:1])
        assert hosts.lpd.cut_at is not None, "no fetch crossed the store link"
        # the worker may have recomputed and finished before D's node gives the fetch up (at
        # its transfer timeout): wait for that failure to be counted
        wait_until("D's node counted the cut fetch",
                   lambda: _delta(before, hosts.counters("d"), "transfer_failures", "tcp"),
                   30, hosts.logs)  # fmt: skip
        after = hosts.counters("d")
        failures = _fetch_failures(hosts.proc("store-d"), started - 1)
        # still cut: another request is served (recomputed) too
        got += _run_all(hosts, "cut2", PROMPTS[1:2])
    finally:
        hosts.lpd.clear()
    assert got == ref[:2]
    assert _delta(before, after, "transfer_failures", "tcp") == 1.0
    [(failed_at, pages)] = failures
    cut_wall = hosts.lpd.cut_wall
    assert cut_wall is not None
    print(
        f"\nstore link cut mid-fetch: D's node gave the fetch of {pages} pages up "
        f"{failed_at - cut_wall:.1f}s after the cut; the worker recomputed"
    )
    skips = _delta(before, hosts.counters("d"), "transfer_skips", "hostp")
    print(f"while cut, a second request: {skips:.0f} fetch(es) from P skipped")
    # healed: fetches from P work again (once D's node tries P again: peer_retry_s)
    healed = hosts.counters("d")
    for attempt in range(6):
        assert _run_all(hosts, f"healed{attempt}", PROMPTS[2:]) == ref[2:]
        fetched = _delta(healed, hosts.counters("d"), "hits", "remote")
        if fetched:
            break
    print(f"after the heal: D fetched {fetched:.0f} pages from P (request {attempt + 1})")
    assert fetched >= 1
    for p in hosts.procs:
        assert p.proc.poll() is None, f"{p.name} exited{hosts.logs()}"
