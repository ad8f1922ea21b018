"""kvrelay vs llama.cpp's llama-server and vLLM's CPU build: same model, same threads, one run.

Each server runs alone on 127.0.0.1 (started, warmed, loaded, stopped), in alternating rounds
(kvrelay, llama, vllm, kvrelay, ...), all on one model (`--model`, default SmolLM2-135M-Instruct):
kvrelay gets `--model M`, llama-server the model's GGUF (or `--llama-model`), vLLM the HF
directory kvrelay converts it to, served under kvrelay's name. Every server gets the same
streamed OpenAI requests, greedy, `ignore_eos` + `min_tokens` so each answer is exactly `--tokens`
long: chat requests when the model has a chat template, else (`--api completions`, the default
for a base model such as Gemma 3 270M) /v1/completions with the messages rendered as one plain
text prompt (`role: content` turns, then `assistant:`). In a closed loop:
- `short`: short chats at each `--streams` level, 2 requests per stream (at least 4);
- `shared-prefix`: `--shared-prefix-streams` (8) whose requests share a ~1,500-token system
  prompt;
- `long-context`: `--long-context-streams` (8 and 32), each request its own 4,000-token document
  (`kvrelay bench --dataset long-context`: kvrelay.bench.datasets builds both);
- `grounded`: `--grounded-streams` (1 and 8), tasks on a passage or a Python file in the prompt
  (summarize, rewrite, edit the code) whose answers copy spans of the input, the case n-gram
  (prompt-lookup) speculative decoding speeds up (`kvrelay bench --dataset grounded`).
Two conversation workloads (benchmarks/conversations.py, on `kvrelay bench`'s datasets and session
runner) measure what each server's prefix cache buys follow-ups, reported by turn (TTFT p50/p90,
prompt tokens served from cache) beside the usual rows, each kvrelay column against the best peer:
- `multi-turn`: `--users` (16) conversations at once of `--turns` (6) turns after a shared
  ~1,500-token system prompt, `--think-time` (30,120 s, seeded) before each follow-up, which
  carries the server's own previous answer;
- `doc-qa`: `--documents` (8) 3,000-token documents asked about in turn, `--turns` asks each.
Every request of a conversation sends `prompt_cache_key` = its id; `--cold` adds a cold twin
of each kvrelay column (`kvrelay-cold`) whose requests each send a `cache_salt` of their own, so
nothing is served from cache (the report gives warm / cold TTFT p90 by turn). vLLM gets
`--enable-prompt-tokens-details` for them, so it reports its cached tokens. To run kvrelay with a
pool smaller than the conversations' working set (`--print-config` gives it in tokens), size its
worker pool and store arena through `--kvrelay-extra "--kv-cache-bytes N --arena-bytes M"`.
Variants run one server several times with different flags, each its own column:
`--kvrelay-variants plain:--speculation off,spec:--speculation ngram` gives `kvrelay` and
`kvrelay-spec`, `--llama-variants plain:,ngram:--spec-type ngram-simple ...` gives `llama` and
`llama-ngram` (`--compare-speculation` sets both to SPEC_VARIANTS; `plain` keeps the bare name).
Each peer runs in its best configuration for the host (`peer_config`: bf16 vLLM and llama-server
`--no-repack` on AMX hosts), with its context and KV pool sized for the busiest level.
Reports output tok/s, TTFT and inter-token latency (SSE chunk gaps) p50/p90, errors, and the
kvrelay/peer ratios. Not part of CI; run it on a quiet machine:

    python benchmarks/peers.py --write-docs                    # full run (see docs/benchmarks.md)
    python benchmarks/peers.py --workloads short,shared-prefix,long-context --write-docs
    python benchmarks/peers.py --workloads long-context --print-config   # settings, no servers
    python benchmarks/peers.py --servers kvrelay --streams 1 --tokens 16 --repeats 1   # smoke
    python benchmarks/peers.py --servers kvrelay,llama --workloads grounded,short \
        --compare-speculation --write-docs          # with and without n-gram speculation
    # another model: a built-in name or a .gguf path (its results get their own docs section)
    python benchmarks/peers.py --model gemma-3-270m --workloads short,long-context \
        --streams 1,8,32 --write-docs
    python benchmarks/peers.py --model gemma-3-270m --print-config
    python benchmarks/peers.py --model gemma-3-270m --servers kvrelay,llama,vllm --streams 1 \
        --tokens 16 --repeats 1 --workloads short                  # smoke
    python benchmarks/peers.py --workloads multi-turn,doc-qa --cold --write-docs   # conversations
    python benchmarks/peers.py --servers kvrelay --workloads multi-turn --users 2 --turns 2 \
        --think-time 0,1 --tokens 16 --repeats 1                   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DOCS,
    SERVERS,
    PeerModel,
    Server,
    cpu_flags,
    cpu_model,
    div,
    isa_line,
    kv_bytes,
    kvrelay_kv_dtype,
    llama_gguf,
    machine_line,
    model_dir,
    pct,
    peer_config,
    peer_model,
    precision,
    write_section,
)
from benchmarks.conversations import (  # noqa: E402
    CONVERSATIONS,
    best_peer_ratios,
    cold_by_turn,
    concurrency,
    conversation_rows,
    plot_turns,
    prompt_tokens,
    request_results,
    run_conversations,
    shape,
    turn_fields,
    turn_tables,
    working_set_tokens,
)
from kvrelay.bench.datasets import (  # noqa: E402
    DOC_QA_DOCUMENTS,
    GROUNDED_MAX_TOKENS,
    LONG_CONTEXT_TOKENS,
    builtin,
)
from kvrelay.bench.request import RequestOptions, RequestRecord, Target, render_prompt  # noqa: E402
from kvrelay.core.modelref import DEFAULT_MODEL  # noqa: E402

MODEL = DEFAULT_MODEL  # --model's default
APIS = ("auto", "chat", "completions")
WORKLOADS = ("short", "shared-prefix", "long-context", "grounded", *CONVERSATIONS)
# Prompt tokens each workload's requests may hold (the shared system prompt is ~1,530 tokens;
# the conversations': conversations.prompt_tokens).
PROMPT_TOKENS = {"short": 128, "shared-prefix": 1700, "long-context": LONG_CONTEXT_TOKENS + 64,
                 "grounded": GROUNDED_MAX_TOKENS + 64}  # fmt: skip
# Draft length of both speculating servers, so they verify the same number of tokens per step.
SPEC_TOKENS = 8
# llama-server's closest match to kvrelay's prompt lookup is ngram-simple: it takes the last n
# tokens (the sampled one included), finds their latest earlier occurrence in the prompt or the
# output and drafts the m tokens that followed it. Its defaults (n 12, m 48) need a 12-token match
# before drafting and then verify 48 tokens a step; a 3-token key is what prompt lookup uses and
# drafts as soon as a copy starts, and m = SPEC_TOKENS. `--spec-draft-n-max` does not bound
# ngram-simple's drafts (it is the draft-model length), so m is the setting. On one grounded
# rewrite (SmolLM2 Q4_1, 2 threads) n 3 m 8 accepted 83 of 100 drafted tokens, 1.15-1.3x the
# decode tok/s of no speculation (two runs); n 2 m 8, n 3 m 16, the defaults and ngram-mod all
# did worse.
LLAMA_NGRAM = (f"--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
               f"--spec-ngram-simple-size-m {SPEC_TOKENS}")  # fmt: skip
# --compare-speculation: each server without and with n-gram speculation.
SPEC_VARIANTS = {
    "kvrelay": f"plain:--speculation off,spec:--speculation ngram --num-speculative-tokens "
    f"{SPEC_TOKENS}",
    "llama": f"plain:,ngram:{LLAMA_NGRAM}",
}
VLLM_DETAILS = "--enable-prompt-tokens-details"  # vLLM's flag for usage.prompt_tokens_details
TOPICS = ["the sea", "mountains", "a city at night", "a robot", "a garden", "the moon",
          "a library", "winter", "trains", "a bakery", "the desert", "rain"]  # fmt: skip


def system_prompt(salt: str, target: int = 1500, model_dir: Path | None = None) -> tuple[str, int]:
    """A deterministic system prompt of about `target` tokens of the model converted in
    `model_dir` (None: SmolLM2) and its size."""
    from tokenizers import Tokenizer

    from kvrelay.core.modelref import converted_dir, resolve_model

    directory = model_dir or converted_dir(resolve_model(MODEL))
    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
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
    if workload in ("long-context", "grounded"):
        data = builtin(workload, seed)
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


def resolve_api(api: str, model: PeerModel) -> str:
    """`chat` or `completions`: auto is chat when the model has a chat template."""
    if api != "auto":
        return api
    return "chat" if model.chat_template else "completions"


def payloads(convs: list[list[dict]], served: str, api: str) -> list[dict]:
    """Each conversation as the model and prompt part of a request: `messages` for chat, one
    plain text `prompt` (kvrelay.bench.request.render_prompt) for completions, so every server
    gets the same text."""
    if api == "chat":
        return [{"model": served, "messages": c} for c in convs]
    return [{"model": served, "prompt": render_prompt(c)} for c in convs]


def chunk_text(event: dict) -> str:
    """The text of one streamed chunk: a chat delta's content (or reasoning) or a completion
    choice's text; empty for role-only, usage-only and empty chunks."""
    choice = (event.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or choice.get("text")
    return text if isinstance(text, str) else ""


SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # --sampling sampled (seeded per request)


async def one(client, url: str, payload: dict, tokens: int, seed: int | None = None) -> dict:
    """One streamed request of `payload` (`payloads`: model + messages or prompt), exactly
    `tokens` long (max_tokens = min_tokens, ignore_eos): greedy, or with `seed` sampled
    (SAMPLED: a small model's greedy answers loop under ignore_eos, which flatters n-gram
    drafting)."""
    body = {
        **payload,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        body.update(SAMPLED, seed=seed)
    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    res = {"ttft": None, "latency": None, "tokens": 0, "chunks": 0, "gaps": [],
           "prompt_tokens": None, "error": None}  # fmt: skip
    start = time.monotonic()
    last = None
    try:
        # A fresh connection per request: llama-server closes kept-alive connections between
        # requests (seen as "Server disconnected without sending a response").
        async with client.stream("POST", url + path, json=body,
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
                if chunk_text(event):
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


async def closed_loop(url: str, convs: list[dict], tokens: int, streams: int,
                      sampled: bool = False) -> tuple[list[dict], float]:  # fmt: skip
    """`streams` users sending `convs` (`payloads`) one after another until none is left
    (`sampled`: request i seeded with i)."""
    import httpx

    queue = list(convs)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=streams + 4)
                                 ) as client:  # fmt: skip

        async def user() -> None:
            while queue:
                seed = len(convs) - len(queue) if sampled else None
                results.append(await one(client, url, queue.pop(0), tokens, seed))

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
        levels += [("shared-prefix", int(s)) for s in args.shared_prefix_streams.split(",") if s]
    if "long-context" in args.workloads:
        levels += [("long-context", int(s)) for s in args.long_context_streams.split(",") if s]
    if "grounded" in args.workloads:
        levels += [("grounded", int(s)) for s in args.grounded_streams.split(",") if s]
    levels += [(w, concurrency(w, args.users, args.shape)) for w in CONVERSATIONS
               if w in args.workloads]  # fmt: skip
    return levels


def parse_variants(text: str, flag: str) -> list[tuple[str, list[str]]]:
    """`NAME:ARGS,NAME:ARGS` as (name, argv) pairs; a comma inside ARGS (`--spec-type a,b`) stays
    there unless `word:` follows it."""
    out: list[tuple[str, list[str]]] = []
    for part in re.split(r",(?=[\w.-]+:)", text.strip()):
        name, sep, extra = part.partition(":")
        name = name.strip()
        if not sep or not re.fullmatch(r"[\w.-]+", name):
            raise SystemExit(f"{flag}: {part!r} is not NAME:ARGS (e.g. plain: or spec:--flag v)")
        if name in (n for n, _ in out):
            raise SystemExit(f"{flag}: variant {name!r} given twice")
        out.append((name, shlex.split(extra)))
    return out


def variant_label(server: str, name: str) -> str:
    """The column of one variant: the server's own name for `plain`, else SERVER-NAME."""
    return server if name == "plain" else f"{server}-{name}"


def lineup(args: argparse.Namespace) -> dict[str, tuple[str, argparse.Namespace]]:
    """Every server column in run order: label -> (server kind, its arguments), where a variant's
    flags follow the server's own --*-extra; with --cold each kvrelay column is followed by its
    cold twin, LABEL-cold (`cold` set: each request a cache_salt of its own)."""
    out: dict[str, tuple[str, argparse.Namespace]] = {}
    for server in args.servers:
        for name, extra in args.variants.get(server, [("plain", [])]):
            own = argparse.Namespace(**vars(args))
            key = f"{server}_extra"
            setattr(own, key, [*getattr(args, key), *extra])
            own.cold = False
            label = variant_label(server, name)
            out[label] = (server, own)
            if server == "kvrelay" and args.cold_twins:
                out[f"{label}-cold"] = (server, argparse.Namespace(**{**vars(own), "cold": True}))
    return out


def max_prompt(workload: str, tokens: int, turns: int) -> int:
    """Prompt tokens a request of `workload` may hold (`tokens` per answer, `turns` turns)."""
    if workload in CONVERSATIONS:
        return prompt_tokens(workload, turns, tokens)
    return PROMPT_TOKENS[workload]


def sizing(levels: list[tuple[str, int]], tokens: int, turns: int) -> tuple[int, int, int]:
    """(slots, tokens per slot, KV tokens in use at once at the busiest level) for the servers."""
    per_slot = max(max_prompt(w, tokens, turns) for w, _ in levels) + tokens
    kv_tokens = max(s * (max_prompt(w, tokens, turns) + tokens) for w, s in levels)
    return max(s for _, s in levels), per_slot, kv_tokens


def working_sets(args: argparse.Namespace) -> dict[str, int]:
    """Prompt tokens each conversation workload's cache must hold to serve every turn warm."""
    return {w: working_set_tokens(w, args.users, args.shape, args.tokens)
            for w in CONVERSATIONS if w in args.workloads}  # fmt: skip


def working_set_bytes(args: argparse.Namespace) -> dict[str, int]:
    """`working_sets` in bytes of kvrelay's KV (its pool plus arena hold them; size them with
    --kvrelay-extra "--kv-cache-bytes N --arena-bytes M")."""
    dtype = kvrelay_kv_dtype(args.kvrelay_extra)
    return {w: kv_bytes(t, dtype, slack=1.0, model_dir=model_dir(args))
            for w, t in working_sets(args).items()}  # fmt: skip


def server_settings(args: argparse.Namespace, flags: set[str]) -> dict:
    """What `run` would start each server with (`--print-config`)."""
    slots, budget, kv_tokens = sizing(workload_levels(args), args.tokens, args.shape.turns)
    servers = {}
    for name, (kind, own) in lineup(args).items():
        server = SERVERS[kind](own, slots, budget, kv_tokens, args.peer)
        servers[name] = server.describe()
        server.stop()  # removes its temporary directory
    return {"cpu": cpu_model(), "isa": isa_line(flags), "rule": args.peer.why,
            "model": model_line(args), "levels": workload_levels(args), "slots": slots,
            "tokens_per_slot": budget, "kv_tokens": kv_tokens,
            "working_set_tokens": working_sets(args),
            "working_set_kvrelay_bytes": working_set_bytes(args), "servers": servers}  # fmt: skip


def model_line(args: argparse.Namespace) -> dict:
    """What each server is given of the model, and the API the requests use."""
    model: PeerModel = args.model
    out = {"given": model.given, "served": model.served, "api": args.api,
           "chat_template": model.chat_template, "kvrelay": f"--model {model.given}"}  # fmt: skip
    if "llama" in args.servers:
        out["llama"] = f"-m {llama_gguf(args)} --alias {model.served}"
    if "vllm" in args.servers:
        out["vllm"] = f"--model {model.dir} --served-model-name {model.served}"
    return out


def conversation_options(args: argparse.Namespace, cold: bool) -> RequestOptions:
    """What every request of a conversation asks for: exactly --tokens, greedy or SAMPLED
    (seeded per request), its conversation's prompt_cache_key and, `cold`, its own cache_salt."""
    sampled = args.sampling == "sampled"
    return RequestOptions(
        args.api,
        args.tokens,
        ignore_eos=True,
        temperature=SAMPLED["temperature"] if sampled else 0.0,
        top_p=SAMPLED["top_p"] if sampled else None,
        seeded=sampled,
        cache_key=True,
        cold=cold,
    )


def salted(convs: list[dict], prefix: str) -> list[dict]:
    """`convs` (`payloads`) each with a cache_salt of its own: a cold column's requests."""
    return [{**c, "cache_salt": f"{prefix}/{i}"} for i, c in enumerate(convs)]


def run_level(
    url: str, name: str, own: argparse.Namespace, workload: str, streams: int, rep: int,
    sys_text: str,
) -> tuple[list[dict], float, list[RequestRecord]]:  # fmt: skip
    """One level of round `rep` against column `name` (arguments `own`) at `url`: its
    per-request results (`one`'s), wall time and, for a conversation workload, the session
    runner's records. Every server of a round gets the same requests, new ones every level."""
    seed = rep * 1000 + streams
    if workload in CONVERSATIONS:
        target = Target(name, url, own.model.served, keep_alive=False)  # as `one` does
        opts = conversation_options(own, own.cold)
        done = asyncio.run(
            run_conversations(target, workload, own.users, own.shape, opts, seed, rep)
        )
        return request_results(done.records), done.duration_s, done.records
    convs = requests_for(
        workload, streams, f"r{rep}-{streams}", sys_text, seed, own.requests_per_stream
    )
    convs = payloads(convs, own.model.served, own.api)
    if own.cold:
        convs = salted(convs, f"cold/r{rep}/{workload}/{streams}")
    res, wall = asyncio.run(closed_loop(url, convs, own.tokens, streams, own.sampling == "sampled"))
    return res, wall, []


def level_row(name: str, workload: str, streams: int, res: list[dict], wall: float,
              records: list[RequestRecord], tokens: int) -> dict:  # fmt: skip
    """One column's row of one level: `summarize`'s fields, and a conversation level's
    by-turn report (conversations.turn_fields)."""
    turns = turn_fields(records) if workload in CONVERSATIONS else {}
    return {"server": name, "workload": workload, "streams": streams,
            **summarize(res, wall, tokens), **turns}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    levels = workload_levels(args)
    slots, budget, kv_tokens = sizing(levels, args.tokens, args.shape.turns)
    raw: dict[tuple[str, str, int], tuple[list[dict], float, list[RequestRecord]]] = {}
    started: dict[str, float] = {}
    failed: dict[str, str] = {}
    configs: dict[str, str] = {}
    prompt_sizes = []
    columns = lineup(args)
    model, api = args.model, args.api
    for rep in range(args.repeats):
        sys_text, n_sys = system_prompt(f"round {rep}", model_dir=model.dir)
        prompt_sizes.append(n_sys)
        for name, (kind, own) in columns.items():
            server: Server = SERVERS[kind](
                own, slots=slots, ctx_per_slot=budget, kv_tokens=kv_tokens, peer=args.peer
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
                warm = payloads(requests_for("short", 2, f"warm{rep}", "")[:2], model.served, api)
                asyncio.run(closed_loop(server.url, warm, min(args.tokens, 16), 2))
                for workload, streams in levels:
                    res, wall, records = run_level(
                        server.url, name, own, workload, streams, rep, sys_text
                    )
                    key = (name, workload, streams)
                    old = raw.get(key, ([], 0.0, []))
                    raw[key] = (old[0] + res, old[1] + wall, old[2] + records)
                    row = level_row(name, workload, streams, res, wall, records, args.tokens)
                    print(json.dumps({"round": rep, **row}), file=sys.stderr, flush=True)
            finally:
                server.stop()
    rows = [level_row(*key, res, wall, records, args.tokens)
            for key, (res, wall, records) in raw.items()]  # fmt: skip
    return results(args, rows, configs, started, failed, prompt_sizes)


def results(
    args: argparse.Namespace,
    rows: list[dict],
    configs: dict[str, str],
    started: dict[str, float],
    failed: dict[str, str],
    prompt_sizes: list[int],
) -> dict:
    """A run's report from its level rows: rows in order, ratios, the conversations' by-turn
    comparisons and what the run was (configs, start-up seconds and failures)."""
    columns = lineup(args)
    order = {w: i for i, w in enumerate(WORKLOADS)}
    names = list(columns)
    rows.sort(key=lambda r: (order[r["workload"]], r["streams"], names.index(r["server"])))
    kinds = {name: kind for name, (kind, _) in columns.items()}
    twins = {name: name.removesuffix("-cold") for name, (_, own) in columns.items() if own.cold}
    return {
        "rows": rows,
        "configs": configs,
        "ratios": ratios(rows, kinds),
        "turn_ratios": best_peer_ratios(rows, kinds),
        "cold_turns": cold_by_turn(rows, twins),
        "working_set_tokens": working_sets(args),
        "start_s": started,
        "start_failures": failed,
        "system_prompt_tokens": prompt_sizes,
    }


def from_log(args: argparse.Namespace, path: Path) -> dict:
    """The report of a run's first round, from the level rows it printed (JSON lines, "round"
    0): a run stopped after its first round still reports it, as a run of --repeats 1. Start-up
    seconds are not in the log."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("round") == 0:
            rows.append({k: v for k, v in json.loads(line).items() if k != "round"})
    if not rows:
        raise SystemExit(f"--from-log: no round 0 rows in {path}")
    args.repeats = 1
    slots, budget, kv_tokens = sizing(workload_levels(args), args.tokens, args.shape.turns)
    configs = {}
    for name, (kind, own) in lineup(args).items():
        server = SERVERS[kind](own, slots=slots, ctx_per_slot=budget, kv_tokens=kv_tokens,
                               peer=args.peer)  # fmt: skip
        configs[name] = server.describe()
        server.stop()  # never started: removes its directory
    return results(args, rows, configs, {}, {}, [])


def ratio_pairs(kinds: dict[str, str]) -> list[tuple[str, str]]:
    """(A, B) column pairs reported as A / B: each variant against its server's plain column
    (kvrelay-spec / kvrelay, llama-ngram / llama), then every kvrelay column against every peer
    column (kvrelay / llama, kvrelay-spec / llama-ngram...). `kinds` maps each column to its
    server, in run order."""
    ours = [n for n, k in kinds.items() if k == "kvrelay"]
    others = [n for n, k in kinds.items() if k != "kvrelay"]
    own = [(n, k) for n, k in kinds.items() if n != k and kinds.get(k) == k]
    return own + [(a, b) for a in ours for b in others]


def ratios(rows: list[dict], kinds: dict[str, str] | None = None) -> list[dict]:
    """A / B for each of `ratio_pairs` at every level both ran; `kinds` defaults to each row's
    server being its own kind."""
    by = {(r["server"], r["workload"], r["streams"]): r for r in rows}
    if kinds is None:
        kinds = {r["server"]: r["server"] for r in rows}
    levels = list(dict.fromkeys((r["workload"], r["streams"]) for r in rows))
    out = []
    for workload, streams in levels:
        for a, b in ratio_pairs(kinds):
            x, y = by.get((a, workload, streams)), by.get((b, workload, streams))
            if x is None or y is None:
                continue
            out.append({"server": a, "peer": b, "workload": workload, "streams": streams,
                        "throughput": div(x["output_tok_s"], y["output_tok_s"]),
                        "ttft_p50": div(x["ttft_ms_p50"], y["ttft_ms_p50"]),
                        "itl_p50": div(x["itl_ms_p50"], y["itl_ms_p50"]),
                        "tpot_p50": div(x["tpot_ms_p50"], y["tpot_ms_p50"])})  # fmt: skip
    return out


def tables(res: dict) -> str:
    cols = ["output_tok_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90",
            "tpot_ms_p50", "errors", "wrong_length", "requests"]  # fmt: skip
    lines = ["| workload | streams | server | " + " | ".join(cols) + " |",
             "|---|---:|---|" + "---:|" * len(cols)]  # fmt: skip
    for r in res["rows"]:
        lines.append(f"| {r['workload']} | {r['streams']} | {r['server']} | "
                     + " | ".join(str(r[c]) for c in cols) + " |")  # fmt: skip
    lines += ["", "| workload | streams | ratio | throughput | TTFT p50 | ITL p50 | TPOT p50 |",
              "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for q in res["ratios"]:
        lines.append(
            f"| {q['workload']} | {q['streams']} | {q['server']} / {q['peer']} | "
            f"{q['throughput']}x | {q['ttft_p50']}x | {q['itl_p50']}x | {q['tpot_p50']}x |"
        )
    return "\n".join(lines)


def workload_notes(args: argparse.Namespace, res: dict) -> str:
    """What the shared-prefix and long-context workloads sent, for those that ran."""
    notes = ""
    if "shared-prefix" in args.workloads:
        notes += (f"; shared-prefix: {args.shared_prefix_streams} streams, a "
                  f"{res['system_prompt_tokens'][0]}-token system "
                  "prompt (new each round)")  # fmt: skip
    if "long-context" in args.workloads:
        other = "" if args.model.is_default else f"; {args.model.served} counts differ"
        notes += (f"; long-context: {args.long_context_streams} streams, each request its own "
                  f"{LONG_CONTEXT_TOKENS}-token document (SmolLM2 tokens, chat template "
                  f"included{other}; new each round and level)")  # fmt: skip
    if "grounded" in args.workloads:
        notes += (f"; grounded: {args.grounded_streams} streams, summaries, rewrites and code "
                  "edits of a passage or Python file given in the prompt (kvrelay bench "
                  "--dataset grounded, new each round and level)")  # fmt: skip
    return notes


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = [r for r in res["rows"] if r["workload"] == "long-context"]
    grounded = [r for r in res["rows"] if r["workload"] == "grounded"]
    n = 4 + bool(long) + bool(grounded)
    fig, axes = plt.subplots(1, n, figsize=(17 + 4 * (n - 4), 4))
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
    shared_rows = [r for r in res["rows"] if r["workload"] == "shared-prefix"]
    level = min((r["streams"] for r in shared_rows), default=8)  # the first level run
    shared = {r["server"]: r["output_tok_s"] or 0 for r in shared_rows if r["streams"] == level}
    axes[3].bar(list(shared), list(shared.values()), color=[f"C{servers.index(s)}" for s in shared])
    axes[3].set_title(f"shared 1,500-token prompt, {level} streams: tok/s")
    bars = [(long, f"{LONG_CONTEXT_TOKENS}-token documents: tok/s"),
            (grounded, "grounded tasks (summarize, rewrite, edit code): tok/s")]  # fmt: skip
    for ax, (rows, title) in zip(axes[4:], [b for b in bars if b[0]], strict=True):
        levels = sorted({r["streams"] for r in rows})
        width = 0.8 / max(1, len(servers))
        for i, s in enumerate(servers):
            tok_s = {r["streams"]: r["output_tok_s"] or 0 for r in rows if r["server"] == s}
            xs = [j + i * width for j in range(len(levels))]
            ax.bar(xs, [tok_s.get(n, 0) for n in levels], width, label=s, color=f"C{i}")
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(levels))],
                      [f"{n} streams" for n in levels])  # fmt: skip
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def conversation_notes(args: argparse.Namespace, res: dict) -> str:
    """What the conversation workloads that ran sent."""
    lo, hi = args.shape.think_s
    notes = []
    for workload, tokens in res["working_set_tokens"].items():
        if workload == "multi-turn":
            notes.append(f"multi-turn: {args.users} conversations at once, {args.turns} turns "
                         f"each after a shared ~1,500-token system prompt, {lo:g}-{hi:g} s of "
                         "think time (seeded) before each follow-up, which carries the server's "
                         "own previous answer")  # fmt: skip
        else:
            users = concurrency(workload, args.users, args.shape)
            notes.append(f"doc-qa: {args.documents} 3,000-token documents asked about in turn, "
                         f"{args.turns} asks each, {users} at once")  # fmt: skip
        notes[-1] += f" ({tokens:,} prompt tokens to hold for every turn to be warm)"
    return "; ".join(notes)


def docs_header(
    args: argparse.Namespace, argv: list[str] | None, res: dict, title: str
) -> list[str]:
    """A docs section's heading and the run's command, model, machine, precision and settings."""
    cmd = "python benchmarks/peers.py " + " ".join(argv or sys.argv[1:])
    prec = "; ".join(f"{k}: {v}" for k, v in res["precision"].items())
    title += "" if args.model.is_default else f" on {args.model.served}"
    title += ", sampled" if args.sampling == "sampled" else ""
    api = "chat" if args.api == "chat" else "completions (messages as plain text)"
    return [
        f"## {title}", "", f"Command: `{cmd.strip()}`  ",
        f"Model: {args.model.served}; streamed {api}  ",
        f"Machine: {res['machine']}; load average at end {res['load_at_end']}  ",
        f"CPU: {res['cpu']}; {res['isa']}  ", f"Precision: {prec}  ",
        f"Peer settings ({res['peer_rule']}): "
        + "; ".join(f"{k}: `{v}`" for k, v in res["configs"].items()) + "  ",
    ]  # fmt: skip


def sampling_line(args: argparse.Namespace) -> str:
    """How the answers were drawn and how long they are."""
    how = "greedy" if args.sampling == "greedy" else f"sampled ({SAMPLED}, seed per request)"
    return (f"{args.threads} threads each, one server at a time, {args.repeats} alternating "
            f"round(s); {how}, {args.tokens} output tokens per request (ignore_eos + "
            "min_tokens)")  # fmt: skip


def write_docs(args: argparse.Namespace, argv: list[str] | None, res: dict) -> None:
    """The run's docs sections, each with its plot: the closed-loop workloads under `peers`
    (another model or sampling: a name of its own), the conversations under NAME-conversations,
    so a run of either leaves the other's results in place."""
    section = "peers" if args.model.is_default else f"peers-{args.model.served}"
    if args.sampling == "sampled":
        section += "-sampled"
    img = args.docs.parent / "img"
    failures = "; ".join(f"{k}: {v[:300]}" for k, v in res["start_failures"].items())
    failed = f"Failed to start: {failures or 'none'}."
    conv = conversation_rows(res["rows"])
    plain = {
        **res,
        "rows": [r for r in res["rows"] if "by_turn" not in r],
        "ratios": [q for q in res["ratios"] if q["workload"] not in CONVERSATIONS],
    }
    if plain["rows"]:
        plot(plain, img / f"{section}.png")
        write_section(section, "\n".join([
            *docs_header(args, argv, res, "Peers: kvrelay vs llama.cpp server vs vLLM (CPU)"),
            f"{sampling_line(args)}, closed loop with {args.requests_per_stream} request(s) per "
            f"stream (at least 4){workload_notes(args, res)}. ITL = gaps between content "
            "chunks (pooled); TPOT = (latency - TTFT) / (tokens - 1) per request (a speculating "
            "server sends several tokens in a chunk, so compare TPOT there). Ratios are A / B: "
            "above 1 favors A for throughput, below 1 for TTFT, ITL and TPOT. Start-up seconds "
            f"(last round): {res['start_s']}.", "",
            tables(plain), "", f"![peers](img/{section}.png)", "", failed,
        ]), doc=args.docs)  # fmt: skip
    if conv:
        name = f"{section}-conversations"
        plot_turns(conv, img / f"{name}.png")
        write_section(name, "\n".join([
            *docs_header(args, argv, res, "Peers: multi-turn conversations and document "
                         "re-asks, kvrelay vs llama.cpp server vs vLLM (CPU)"),
            f"{sampling_line(args)}; {conversation_notes(args, res)}. Each request sends its "
            "conversation's id as prompt_cache_key; a -cold column sends each request a "
            "cache_salt of its own. Turns count from 1 (doc-qa: the n-th ask of a document); "
            "by-turn percentiles interpolate (kvrelay bench's), the first table's take the "
            "nearest rank. Best-peer ratios: the kvrelay column over the peer best at each (TTFT "
            "p90 of turns >= 2: below 1 favors kvrelay; output tok/s: above 1); warm / cold: "
            f"below 1 is what the cache saves. Start-up seconds (last round): {res['start_s']}.",
            "", tables({**res, "rows": conv, "ratios": [q for q in res["ratios"]
                                                        if q["workload"] in CONVERSATIONS]}),
            "", turn_tables(res), "", f"![{name}](img/{name}.png)", "", failed,
        ]), doc=args.docs)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="kvrelay,llama,vllm")
    p.add_argument(
        "--model",
        default=MODEL,
        help=f"the model every server runs: a kvrelay built-in name or a .gguf / HF path "
        f"(default {MODEL}); kvrelay gets --model, llama-server its GGUF, vLLM its converted "
        "directory",
    )
    p.add_argument(
        "--api",
        choices=APIS,
        default="auto",
        help="chat (/v1/chat/completions) or completions (/v1/completions, the messages as "
        "one plain text prompt); auto: chat when the model has a chat template",
    )
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument(
        "--workloads", default="short,shared-prefix", help=f"comma-separated: {','.join(WORKLOADS)}"
    )
    p.add_argument("--long-context-streams", default="8,32", help="long-context's stream levels")
    p.add_argument("--shared-prefix-streams", default="8", help="shared-prefix's stream levels")
    p.add_argument("--grounded-streams", default="1,8", help="grounded's stream levels")
    p.add_argument(
        "--requests-per-stream", type=int, default=2, help="requests per stream and level (2)"
    )
    p.add_argument("--users", type=int, default=16,
                   help="multi-turn and doc-qa: conversations at once (doc-qa: at most "
                   "--documents) (16)")  # fmt: skip
    p.add_argument("--turns", type=int, default=6,
                   help="multi-turn: turns per conversation; doc-qa: asks per document "
                   "(6)")  # fmt: skip
    p.add_argument("--think-time", default="30,120", metavar="S|LOW,HIGH",
                   help="multi-turn: seconds before each follow-up, uniform in LOW..HIGH, "
                   "seeded (30,120)")  # fmt: skip
    p.add_argument("--documents", type=int, default=DOC_QA_DOCUMENTS,
                   help=f"doc-qa: documents asked about in turn ({DOC_QA_DOCUMENTS})")  # fmt: skip
    p.add_argument("--cold", dest="cold_twins", action="store_true",
                   help="a cold twin of each kvrelay column (LABEL-cold): each request a "
                   "cache_salt of its own, so nothing is served from cache")  # fmt: skip
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds")
    p.add_argument("--sampling", choices=("greedy", "sampled"), default="greedy",
                   help="greedy, or sampled (temperature 0.8, top_p 0.95, seeded per request); "
                   "sampled results get their own docs section")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "fp16", "int8-weight-only", "q8_0", "w8a16"),
        default="auto",
        help="kvrelay's weights (`kvrelay up --quantization`; auto: its default for the host)",
    )
    p.add_argument("--kvrelay-extra", default="", help="more `kvrelay up` arguments (one string)")
    p.add_argument("--llama-server", default="/work/peers/llamacpp/llama_cpp_python-0.3.36/"
                   "vendor/llama.cpp/build/bin/llama-server")  # fmt: skip
    p.add_argument(
        "--llama-model",
        default=None,
        help="llama-server's GGUF (default: --model's own; needed when --model is no GGUF)",
    )
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
    for server in SERVERS:
        p.add_argument(
            f"--{server}-variants",
            default=None,
            metavar="NAME:ARGS,...",
            help=f"run {server} once per variant, ARGS added to --{server}-extra; columns "
            f"{server} (NAME plain) and {server}-NAME",
        )
    p.add_argument(
        "--compare-speculation",
        action="store_true",
        help="variants without and with n-gram speculation where not given: "
        + "; ".join(f"--{k}-variants '{v}'" for k, v in SPEC_VARIANTS.items()),
    )
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--from-log",
        type=Path,
        default=None,
        metavar="FILE",
        help="report (and --write-docs) the first round of a run from the level rows it "
        "printed to stderr (a run stopped after it), with that run's flags; starts no server",
    )
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
    if args.users < 1:
        raise SystemExit(f"--users must be >= 1, got {args.users}")
    args.shape = shape(args.turns, args.think_time, args.documents)
    flags = cpu_flags()
    args.peer = peer_config(flags, args.vllm_dtype)
    args.model = peer_model(args.model)
    args.api = resolve_api(args.api, args.model)
    if "llama" in args.servers:
        llama_gguf(args)  # SystemExit now, not after the other servers ran
    for extra in ("kvrelay_extra", "llama_extra", "vllm_extra"):
        setattr(args, extra, shlex.split(getattr(args, extra)))
    if set(CONVERSATIONS) & set(args.workloads) and VLLM_DETAILS not in args.vllm_extra:
        args.vllm_extra.append(VLLM_DETAILS)  # its usage chunk carries cached_tokens only then
    args.variants = {}
    for server in SERVERS:
        text = getattr(args, f"{server}_variants")
        if text is None and args.compare_speculation:
            text = SPEC_VARIANTS.get(server)
        if text is None:
            continue
        if server not in args.servers:
            if getattr(args, f"{server}_variants") is not None:
                raise SystemExit(f"--{server}-variants: {server} is not in --servers")
            continue
        args.variants[server] = parse_variants(text, f"--{server}-variants")
    if args.print_config:
        print(json.dumps(server_settings(args, flags), indent=1))
        return 0
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = machine_line()
    load_start = os.getloadavg()[0]
    res = run(args) if args.from_log is None else from_log(args, args.from_log)
    res.update(machine=machine, load_at_end=round(os.getloadavg()[0], 2),
               load_at_start=round(load_start, 2), cpu=cpu_model(), isa=isa_line(flags),
               peer_rule=args.peer.why,
               precision={name: precision(kind, own, args.peer)
                          for name, (kind, own) in lineup(args).items()})  # fmt: skip
    res.update(model=model_line(args))
    print(json.dumps({"benchmark": "peers", **res}))
    print(tables(res))
    if conversation_rows(res["rows"]):
        print()
        print(turn_tables(res))
    if args.write_docs:
        write_docs(args, argv, res)
    return 0 if all(r["errors"] == 0 for r in res["rows"]) and not res["start_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
