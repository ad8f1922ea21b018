"""Tenants on one stack (issue 50), measured through `kvrelay up --scheduling-policy priority`:

- `fairness`: tenant B sends `--rate` chats a second alone, then beside tenant A sending
  `--ratio` (10) times as many into the saturated stack: B's TTFT p50/p90 alone and beside A,
  under `--scheduling-policy priority` (fair shares) and, for contrast, `fcfs`; B's requests
  go from a process of their own (A's hundreds of open streams would delay B's client). Then both
  tenants backlogged (`--streams` closed-loop clients each) with weights 1 and `--weight-b`:
  the tokens each is served (prompt + completion of the requests that finished in the
  window), against the weights.
- `priority`: a priority-0 chat's TTFT alone (sequential), then under a saturating load of
  priority-10 chats (`--streams` closed-loop clients): p50/p90/p99 and the ratio; and every
  priority-10 request's queue wait (from its record) against `--priority-age-s`.

Every request is a streamed chat of exactly `--tokens` tokens (greedy, ignore_eos) on a prompt
of ~`--prompt-words` words, unique per request (nothing cached). Not part of CI; run it on a
quiet machine:

    python benchmarks/tenants.py fairness
    python benchmarks/tenants.py priority
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import free_port, kvrelay_cli, machine_line, pct  # noqa: E402

MODEL = "smollm2-135m-instruct"
WARM_S = 15.0
WORDS = ["river", "stone", "lamp", "orchard", "violet", "thunder", "meadow", "copper"]
KEYS = """
[[key]]
name = "a"
key = "sk-a"
priority_range = [0, 10]

[[key]]
name = "b"
key = "sk-b"
weight = {weight_b}
priority_range = [0, 10]
"""


class Stack:
    def __init__(self, policy: str, weight_b: float, extra: list[str]):
        root = Path(tempfile.mkdtemp(prefix="tenants-"))
        keys = root / "keys.toml"
        keys.write_text(KEYS.format(weight_b=weight_b))
        self.run_dir, self.port = root / "run", free_port()
        self.flags = ["--scheduling-policy", policy, "--api-keys-file", str(keys), *extra]

    def __enter__(self) -> Stack:
        kvrelay_cli("up", "--detach", "--run-dir", str(self.run_dir), "--port", str(self.port),
                    *self.flags)  # fmt: skip
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=900)
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        kvrelay_cli("down", "--run-dir", str(self.run_dir))

    def chat(self, key: str, tokens: int, words: int, priority: int | None = None) -> dict:
        """One streamed chat: ttft and end (seconds from the post), tokens, its request id."""
        rng = random.Random()
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True,
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if priority is not None:
            body["priority"] = priority
        start, ttft, usage, rid = time.monotonic(), None, None, None
        headers = {"Authorization": f"Bearer {key}"}
        with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            rid = r.headers.get("x-request-id")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or [{}]
                if ttft is None and choices[0].get("delta", {}).get("content"):
                    ttft = time.monotonic() - start  # the first token's text, not the role
                usage = event.get("usage") or usage
        end = time.monotonic() - start
        served = (usage or {}).get("prompt_tokens", 0) + (usage or {}).get("completion_tokens", 0)
        return {"ttft": ttft, "end": end, "served": served, "id": rid, "posted": start}

    def queue_wait(self, rid: str, key: str) -> float | None:
        """Seconds from queued to started (the request's record)."""
        resp = self.client.get(f"/v1/requests/{rid}", headers={"Authorization": f"Bearer {key}"})
        if resp.status_code != 200:
            return None
        data = resp.json()
        created, started = data.get("created"), data.get("started")
        return None if created is None or started is None else started - created


class Client:
    """What a separate process needs of a stack to chat with it: its port."""

    def __init__(self, port: int):
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900)

    chat = Stack.chat


def _apart(port: int, key: str, rate: float, seconds: float, tokens: int, words: int, q) -> None:
    out: list[dict] = []
    args = argparse.Namespace(tokens=tokens, prompt_words=words)
    open_loop(Client(port), key, rate, seconds, args, out)  # type: ignore[arg-type]
    q.put(out)


def open_loop_apart(stack: Stack, key: str, rate: float, seconds: float, args) -> list[dict]:
    """`open_loop` in a process of its own: its TTFTs do not wait for the threads of another
    tenant's streams in this one (a Python process on the same 2 cores as the stack)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=_apart, args=(stack.port, key, rate, seconds, args.tokens, args.prompt_words, q)
    )
    proc.start()
    out = q.get()
    proc.join()
    return out


def open_loop(stack: Stack, key: str, rate: float, seconds: float, args, out: list) -> None:
    """Poisson arrivals of `rate` a second for `seconds`, each on its own thread."""
    rng = random.Random(hash(key))
    deadline = time.monotonic() + seconds
    threads = []
    while time.monotonic() < deadline:
        t = threading.Thread(
            target=lambda: out.append(stack.chat(key, args.tokens, args.prompt_words)),
            daemon=True,
        )
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()


def closed_loop(stack: Stack, key: str, streams: int, stop: threading.Event, args, out: list,
                priority: int | None = None) -> list[threading.Thread]:  # fmt: skip
    def client() -> None:
        while not stop.is_set():
            out.append(stack.chat(key, args.tokens, args.prompt_words, priority))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def summary(results: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"n": len(results), "ttft_p50": pct(ttfts, 0.5), "ttft_p90": pct(ttfts, 0.9),
            "ttft_p99": pct(ttfts, 0.99), "ttfts": sorted(round(t, 4) for t in ttfts)}  # fmt: skip


def fairness(args) -> dict:
    report: dict = {}
    for policy in args.policies.split(","):
        with Stack(policy, 1.0, args.extra.split()) as stack:
            # warm: a new worker faults its KV pool in while it serves (~10 s)
            open_loop_apart(stack, "sk-b", args.rate, WARM_S, args)
            alone = open_loop_apart(stack, "sk-b", args.rate, args.seconds, args)
            a_out: list[dict] = []
            flood = threading.Thread(
                target=open_loop,
                args=(stack, "sk-a", args.rate * args.ratio, args.seconds, args, a_out),
            )
            flood.start()
            time.sleep(args.seconds / 6)  # A's backlog builds first
            beside = open_loop_apart(stack, "sk-b", args.rate, args.seconds * 2 / 3, args)
            flood.join()
        b_alone, b_beside = summary(alone), summary(beside)
        ratio = (b_beside["ttft_p90"] or 0) / (b_alone["ttft_p90"] or 1)
        report[policy] = {"b_alone": b_alone, "b_beside_a": b_beside, "a": summary(a_out),
                          "b_p90_ratio": ratio}  # fmt: skip
        print(policy, json.dumps(report[policy]), flush=True)
    with Stack("priority", args.weight_b, args.extra.split()) as stack:
        stop = threading.Event()
        served: dict[str, list[dict]] = {"sk-a": [], "sk-b": []}
        threads = []
        for key in served:
            threads += closed_loop(stack, key, args.streams, stop, args, served[key])
        time.sleep(args.seconds / 3)  # both backlogged
        begin = time.monotonic()
        time.sleep(args.seconds)
        end = time.monotonic()
        stop.set()
        for t in threads:
            t.join()
    tokens = {k: sum(r["served"] for r in v if begin <= r["posted"] + r["end"] <= end)
              for k, v in served.items()}  # fmt: skip
    share = tokens["sk-b"] / max(1, tokens["sk-a"])
    report["weighted"] = {"tokens": tokens, "b_over_a": share, "weight_b_over_a": args.weight_b,
                          "error": share / args.weight_b - 1}  # fmt: skip
    print("weighted", json.dumps(report["weighted"]), flush=True)
    return report


def priority(args) -> dict:
    extra = [*args.extra.split(), "--priority-age-s", str(args.priority_age_s)]
    with Stack("priority", 1.0, extra) as stack:
        stack.chat("sk-a", args.tokens, args.prompt_words, 0)  # warm
        idle = [stack.chat("sk-a", args.tokens, args.prompt_words, 0) for _ in range(args.samples)]
        stop = threading.Event()
        low: list[dict] = []
        threads = closed_loop(stack, "sk-b", args.streams, stop, args, low, priority=10)
        time.sleep(args.seconds / 4)
        loaded = []
        for _ in range(args.samples):
            loaded.append(stack.chat("sk-a", args.tokens, args.prompt_words, 0))
            time.sleep(args.gap)
        stop.set()
        for t in threads:
            t.join()
        with ThreadPoolExecutor(8) as pool:
            found = pool.map(lambda r: stack.queue_wait(r["id"], "sk-b"), low)
            waits = [w for w in found if w is not None]
    i, u = summary(idle), summary(loaded)
    ratio = (u["ttft_p99"] or 0) / (i["ttft_p99"] or 1)
    report = {"idle": i, "under_p10_load": u, "p99_ratio": ratio,
              "p10_requests": len(low), "p10_wait_max_s": max(waits, default=None),
              "priority_age_s": args.priority_age_s}  # fmt: skip
    print(json.dumps(report), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", choices=["fairness", "priority"])
    parser.add_argument("--rate", type=float, default=0.5, help="tenant B's chats a second")
    parser.add_argument("--ratio", type=float, default=10.0, help="A's rate over B's")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--streams", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--weight-b", type=float, default=2.0)
    parser.add_argument("--samples", type=int, default=40, help="priority-0 chats measured")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between them")
    parser.add_argument("--priority-age-s", type=float, default=30.0)
    parser.add_argument("--policies", default="priority,fcfs")
    parser.add_argument(
        "--extra",
        default="--env KVRELAY_WORKER_MAX_NUM_SEQS=8",
        help="more `kvrelay up` flags (default: 8 sequences a step, so --streams saturate)",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()
    report = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    report[args.experiment] = fairness(args) if args.experiment == "fairness" else priority(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
