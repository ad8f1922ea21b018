"""A long conversation on a sliding-window model through a running stack: the KV blocks each
KV group holds as the conversation grows, read from the decode worker's
`kvrelay:kv_group_blocks` while every turn runs.

    kvrelay up --model gemma-3-270m --run-dir RUN &
    python benchmarks/window_memory.py http://127.0.0.1:8000 --run-dir RUN --tokens 6000

Each turn sends the whole conversation so far plus a new user line to /v1/completions (a base
model: no chat template) and appends the answer (--answer tokens, sampled, `ignore_eos`), until
the prompt passes --tokens. A thread scrapes the worker's metrics every 20 ms; per turn it
prints the prompt's tokens, the most blocks the full-attention group(s) and each sliding-window
group held, and what a full-attention pool would have held (every layer, every page).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time

import httpx

SERIES = re.compile(r"^kvrelay:kv_group_blocks\{([^}]*)\}\s+([0-9.e+]+)", re.M)


def worker_metrics_url(run_dir: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "status", "--run-dir", run_dir, "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for w in json.loads(out)["workers"]:
        if w.get("metrics_port"):
            return f"http://127.0.0.1:{w['metrics_port']}/metrics"
    raise SystemExit("no worker with a metrics port in `kvrelay status`")


def scrape(client: httpx.Client, url: str) -> dict[tuple[int, int], float]:
    """{(group, window): blocks held}."""
    out = {}
    for labels, value in SERIES.findall(client.get(url).text):
        kv = dict(part.split("=", 1) for part in labels.split(","))
        out[(int(kv["group"].strip('"')), int(kv["window"].strip('"')))] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--run-dir", default="kvrelay-run")
    ap.add_argument("--metrics", default=None, help="the worker's /metrics URL (default: status)")
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=6000, help="stop once the prompt passes it")
    ap.add_argument("--answer", type=int, default=200, help="tokens per answer")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    metrics = args.metrics or worker_metrics_url(args.run_dir)
    client = httpx.Client(timeout=600)
    peak: dict[tuple[int, int], float] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for key, value in scrape(client, metrics).items():
                peak[key] = max(peak.get(key, 0.0), value)
            time.sleep(0.02)

    text = "A conversation between a curious user and a patient assistant.\n"
    turn = 0
    print("turn  prompt_tokens  full_group_peak  local_groups_peak  all_layers_full_pool")
    while True:
        turn += 1
        text += f"User: tell me more about topic number {turn}, in detail.\nAssistant:"
        peak.clear()
        thread = threading.Thread(target=sample, daemon=True)
        stop.clear()
        thread.start()
        body = {"model": args.model, "prompt": text, "max_tokens": args.answer,
                "temperature": 0.8, "seed": turn, "ignore_eos": True}  # fmt: skip
        resp = client.post(args.url + "/v1/completions", json=body)
        stop.set()
        thread.join()
        resp.raise_for_status()
        data = resp.json()
        text += data["choices"][0]["text"] + "\n"
        prompt = data["usage"]["prompt_tokens"]
        total = prompt + data["usage"]["completion_tokens"]
        full = [v for (g, w), v in sorted(peak.items()) if w == 0]
        local = [v for (g, w), v in sorted(peak.items()) if w > 0]
        groups = len(peak) or 1
        pages = -(-total // args.page_size)
        print(f"{turn:4d}  {prompt:13d}  {','.join(f'{v:.0f}' for v in full):>15}  "
              f"{','.join(f'{v:.0f}' for v in local):>17}  {groups * pages:20d}")  # fmt: skip
        if prompt >= args.tokens:
            break


if __name__ == "__main__":
    main()
