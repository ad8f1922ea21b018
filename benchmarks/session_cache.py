"""What the page store's session features buy, measured through `kvrelay up` (issue 49):

- `prefetch`: how much of a store fetch the queue wait hides when a request's pages sit on disk.
  `--documents` documents (doc-qa's, ~3,000 tokens each) are asked once, naming themselves
  (`prompt_cache_key`); `kvrelay kv evict --tier host` moves every page to disk (files in the
  OS page cache: what is measured is the disk tier's read, verify and promote, not a device;
  dropping the page cache also evicts the mapped weights, which the worker then reads back
  from the device for minutes) and the worker is restarted (SIGKILL: an empty device cache);
  then every document is asked again, all at once, to a worker that takes one request at a
  time (`--max-num-seqs 1`), so they wait in the queue. The worker's load spans
  (`kvrelay:kv_store_fetch_seconds{phase="load"}`) give the time its loads took; a run with
  `--env KVRELAY_STORE_PREFETCH=off` against one with prefetch on gives the part the queued wait
  hid: 1 - on / off (per page loaded).
- `restart`: `--users` conversations of two turns (the shared ~1,500-token system prompt, a
  question, a `--tokens` answer) with `kvrelay down` and `up` between the turns: the share of
  the second turn's prompt served from cache, against the pages the first turn left (its prompt
  and answer, whole pages).

Not part of CI; run it on a quiet machine:

    python benchmarks/session_cache.py prefetch --documents 8
    python benchmarks/session_cache.py restart --users 16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import free_port, kvrelay_cli, machine_line  # noqa: E402
from kvrelay.bench.datasets import doc_qa_document, shared_system_prompt  # noqa: E402

MODEL = "smollm2-135m-instruct"
PAGE = 16
# a restarted worker faults its KV pool in on a thread once it serves (a fresh pool's first
# copies would pay the page faults): this long is ample for the default 1 GiB pool
POOL_FAULT_S = 10.0
_SPAN = re.compile(r'kvrelay:kv_store_fetch_seconds_(sum|count)\{[^}]*phase="load"[^}]*\} (\S+)')


class Stack:
    """`kvrelay up --detach` on a run dir of its own; `down`, and `up` again on the same dir."""

    def __init__(self, flags: list[str]):
        self.run_dir = Path(tempfile.mkdtemp(prefix="session-cache-")) / "run"
        self.port, self.flags = free_port(), flags

    def up(self) -> None:
        kvrelay_cli("up", "--detach", "--run-dir", str(self.run_dir), "--port", str(self.port),
                    *self.flags)  # fmt: skip

    def down(self) -> None:
        kvrelay_cli("down", "--run-dir", str(self.run_dir))

    def json(self, *argv: str) -> dict:
        return json.loads(kvrelay_cli(*argv, "--json", "--run-dir", str(self.run_dir)).stdout)

    def restart_worker(self) -> None:
        """SIGKILL the worker; return once its successor serves (a new pid with a metrics port)."""
        old = self.json("status")["workers"][0]["pid"]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            workers = self.json("status")["workers"]
            if workers and workers[0]["pid"] != old and workers[0].get("metrics_port"):
                time.sleep(POOL_FAULT_S)
                return
        raise TimeoutError("the worker did not come back")

    def load_spans(self) -> tuple[float, float]:
        """(seconds, loads) of the decode worker's store loads so far."""
        workers = self.json("status")["workers"]
        port = next(w["metrics_port"] for w in workers if w.get("metrics_port"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        found = {kind: float(value) for kind, value in _SPAN.findall(text.decode())}
        return found.get("sum", 0.0), found.get("count", 0.0)

    def chat(self, messages: list[dict], key: str, tokens: int) -> dict:
        """One greedy chat of exactly `tokens` tokens: its usage, answer and seconds."""
        body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "prompt_cache_key": key}  # fmt: skip
        start = time.monotonic()
        resp = httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body,
                          timeout=900)  # fmt: skip
        resp.raise_for_status()
        data = resp.json()
        return {"usage": data["usage"], "answer": data["choices"][0]["message"]["content"],
                "seconds": time.monotonic() - start}  # fmt: skip


def cached(result: dict) -> int:
    return result["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def prefetch_run(args: argparse.Namespace, prefetch: bool) -> dict:
    flags = ["--env", f"KVRELAY_STORE_PREFETCH={'local' if prefetch else 'off'}",
             "--env", "KVRELAY_WORKER_MAX_NUM_SEQS=1"]  # fmt: skip
    stack = Stack(flags)
    stack.up()
    try:
        asks = [[{"role": "user", "content": f"{doc_qa_document(args.seed, d)}\n\n"
                  "What is this text about?"}] for d in range(args.documents)]  # fmt: skip
        for d, messages in enumerate(asks):
            stack.chat(messages, f"doc-{d}", args.tokens)
        stack.json("kv", "evict", "--tier", "host")
        stack.restart_worker()
        before_store = stack.json("kv", "stats")["counters"]
        seconds0, loads0 = stack.load_spans()
        with ThreadPoolExecutor(len(asks)) as pool_:
            again = list(pool_.map(lambda d: stack.chat(asks[d], f"doc-{d}", args.tokens),
                                   range(len(asks))))  # fmt: skip
        seconds1, loads1 = stack.load_spans()
        after_store = stack.json("kv", "stats")["counters"]
    finally:
        stack.down()
    pages = sum(cached(r) for r in again) // PAGE
    return {
        "prefetch": prefetch,
        "loads": loads1 - loads0,
        "load_s": round(seconds1 - seconds0, 4),
        "pages_cached": pages,
        "ms_per_page": round(1000 * (seconds1 - seconds0) / pages, 4) if pages else None,
        "prefetched": {
            k: after_store.get("prefetch_pages", {}).get(k, 0)
            - before_store.get("prefetch_pages", {}).get(k, 0)
            for k in ("disk", "remote")
        },  # fmt: skip
        "prefetch_hits": sum(after_store.get("prefetch_hits", {}).values())
        - sum(before_store.get("prefetch_hits", {}).values()),
        "latency_s": sorted(round(r["seconds"], 3) for r in again),
    }


def prefetch(args: argparse.Namespace) -> dict:
    off = prefetch_run(args, prefetch=False)
    on = prefetch_run(args, prefetch=True)
    hidden = None
    if off["ms_per_page"] and on["ms_per_page"] is not None:
        hidden = round(1 - on["ms_per_page"] / off["ms_per_page"], 3)
    return {"off": off, "on": on, "hidden": hidden}


def restart(args: argparse.Namespace) -> dict:
    stack = Stack([])
    system = shared_system_prompt()
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": f"User {u}: describe a city you would visit."}]
             for u in range(args.users)]  # fmt: skip
    stack.up()
    try:
        with ThreadPoolExecutor(args.users) as pool:
            first = list(pool.map(lambda u: stack.chat(convs[u], f"user-{u}", args.tokens),
                                  range(args.users)))  # fmt: skip
        stack.down()
        stack.up()
        second = []
        with ThreadPoolExecutor(args.users) as pool:
            follow = [[*convs[u], {"role": "assistant", "content": first[u]["answer"]},
                       {"role": "user", "content": "And what would you eat there?"}]
                      for u in range(args.users)]  # fmt: skip
            second = list(pool.map(lambda u: stack.chat(follow[u], f"user-{u}", args.tokens),
                                   range(args.users)))  # fmt: skip
        sessions = stack.json("kv", "stats")["pages"]["sessions"]
    finally:
        stack.down()
    hit = sum(cached(r) for r in second)
    prompt = sum(r["usage"]["prompt_tokens"] for r in second)
    # what the first turn left in pages: its prompt and answer, whole pages (the last token of
    # the answer is never computed)
    left = sum((r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1) // PAGE * PAGE
               for r in first)  # fmt: skip
    return {"users": args.users, "sessions_after_restart": sessions, "cached_tokens": hit,
            "prompt_tokens": prompt, "cached_of_prompt": round(hit / prompt, 4),
            "cached_of_first_turn_pages": round(hit / left, 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("prefetch", "restart"))
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="answer length (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = prefetch(args) if args.what == "prefetch" else restart(args)
    print(json.dumps({"machine": machine_line(), "date": time.strftime("%Y-%m-%d"),
                      "command": " ".join(sys.argv), **result}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
