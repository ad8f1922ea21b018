"""One streaming client against an OpenAI-compatible server: inter-token latency (ITL) at 1 stream.

    python benchmarks/one_stream.py http://127.0.0.1:8000 --seconds 10 [--pids PID ...]

Sends streamed chat requests one after another (greedy, `ignore_eos`, --max-tokens each) for
--seconds and prints the ITL p50/p90/mean between SSE events (each kvrelay or llama-server event
is one token at 1 stream). --pids: processes of the stack (worker, ingress, valkey) whose CPU time
per token is printed per thread (/proc, Linux), which is where a token's CPU goes besides the step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import httpx


def _cpu(pids: list[int]) -> dict[tuple[int, int, str], float]:
    """CPU seconds (user + system) of every thread of `pids`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                comm = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[(pid, int(task.name), comm)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run(url: str, seconds: float, max_tokens: int, model: str) -> tuple[list[float], int]:
    itls: list[float] = []
    n = 0
    end = time.monotonic() + seconds
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < end:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Write a story about robot {n}."}],
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            last = None
            with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.perf_counter()
                        if last is not None:
                            itls.append(now - last)
                        last = now
            n += 1
    return itls, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pids", type=int, nargs="*", default=[])
    args = ap.parse_args()
    before = _cpu(args.pids)
    itls, n = run(args.url.rstrip("/"), args.seconds, args.max_tokens, args.model)
    after = _cpu(args.pids)
    itls.sort()
    tokens = len(itls) + n
    ms = [x * 1000 for x in itls]
    print(
        f"requests {n} tokens {tokens} ITL p50 {ms[len(ms) // 2]:.2f} ms "
        f"p90 {ms[int(len(ms) * 0.9)]:.2f} ms mean {sum(ms) / len(ms):.2f} ms"
    )
    rows = sorted(((after[k] - v) * 1000 / tokens, k) for k, v in before.items() if k in after)
    for per_tok, (pid, tid, comm) in reversed(rows):
        if per_tok > 0:
            print(f"  cpu {per_tok:.3f} ms/token  pid {pid} tid {tid} {comm}")


if __name__ == "__main__":
    main()
