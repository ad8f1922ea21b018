"""`kvrelay generate`: run the engine in-process on one prompt or a JSONL batch (no Redis).

Top-level imports stay light (argparse, json); torch and the engine load inside `run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.cli.errors import CommandError
from kvrelay.cli.worker import (
    ATTENTION_HELP,
    KV_DTYPE_HELP,
    QUANTIZATION_HELP,
    SPECULATION_FIELDS,
    SPECULATION_HELP_TABLE,
    flag_options,
)

EXIT_BAD_INPUT = 2
DEFAULT_MAX_TOKENS = 128  # when neither the request nor the model's defaults give max_tokens
_REQUEST_KEYS = {"id", "prompt", "messages"}


class CLIInputError(CommandError, ValueError):
    """Bad flags or batch file: reported as one line on stderr, exit code 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (or give --batch-file)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--model", default=None, help="model name or path (default smollm2)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="chat template instead of the model's own (a Jinja file or the template text), "
        "as `kvrelay up --chat-template`",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate (default: the model's, else {DEFAULT_MAX_TOKENS})",
    )
    given = "default: the model's, as the server applies it, else"
    p.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({given} 1.0)")
    p.add_argument("--top-p", type=float, default=None, help=f"({given} 1.0)")
    p.add_argument("--top-k", type=int, default=None, help=f"({given} 0 = off)")
    p.add_argument("--min-p", type=float, default=None, help=f"({given} 0)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    p.add_argument(
        "--batch-file",
        type=Path,
        default=None,
        help='JSONL file: {"id", "prompt"|"messages", sampling fields...} per line',
    )
    for flag, dest, kind, help_text in engine_flags():
        p.add_argument(
            flag, dest=dest, type=kind, default=None, help=help_text, **flag_options(dest)
        )


# (field, help): the engine's flags, generated from EngineConfig; its variables are the
# worker's (KVRELAY_WORKER_*, see kvrelay.workers.config).
_ENGINE_HELP: list[tuple[str, ...]] = [
    ("max_num_seqs", "most sequences per step"),
    ("max_num_batched_tokens", "most tokens per step"),
    ("num_threads", "torch compute threads (none: torch's default)"),
    ("quantization", QUANTIZATION_HELP),
    ("kv_cache_dtype", KV_DTYPE_HELP),
    ("attention_precision", ATTENTION_HELP + " (here fp32 by default: the same bits anywhere)"),
    *SPECULATION_HELP_TABLE,
]


def engine_flags() -> list[tuple[str, str, Any, str]]:
    """(flag, field, type, help) of the engine settings `generate` takes."""
    from kvrelay.core.config import setting_flags
    from kvrelay.workers.config import SECTION, engine_env_names
    from kvrelay.workers.engine.config import EngineConfig

    return setting_flags(EngineConfig, SECTION, _ENGINE_HELP, engine_env_names())


def _sampling_fields() -> set[str]:
    from kvrelay.core.sampling import SamplingParams

    return {f.name for f in dataclasses.fields(SamplingParams)}


def _flag_sampling(args: argparse.Namespace) -> dict[str, Any]:
    flags = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    return {k: v for k, v in flags.items() if v is not None}


def _read_batch(path: Path, defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """Parse and check the batch file (before the model loads, so mistakes fail fast)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CLIInputError(f"cannot read batch file {path}: {exc.strerror}") from exc
    allowed = _REQUEST_KEYS | _sampling_fields()
    requests, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CLIInputError(f"{path}:{n}: invalid JSON ({exc.msg})") from exc
        if not isinstance(item, dict):
            raise CLIInputError(f"{path}:{n}: each line must be a JSON object")
        unknown = sorted(set(item) - allowed)
        if unknown:
            raise CLIInputError(f"{path}:{n}: unknown field(s) {', '.join(unknown)}")
        rid = str(item.get("id", f"req-{n}"))
        if rid in seen:
            raise CLIInputError(f"{path}:{n}: duplicate id {rid!r}")
        seen.add(rid)
        if ("prompt" in item) == ("messages" in item):
            raise CLIInputError(f"{path}:{n}: give exactly one of 'prompt' or 'messages'")
        sampling = {**defaults, **{k: v for k, v in item.items() if k not in _REQUEST_KEYS}}
        requests.append(
            {
                "id": rid,
                "prompt": item.get("prompt"),
                "messages": item.get("messages"),
                "sampling": sampling,
                "line": n,
            }
        )
    if not requests:
        raise CLIInputError(f"{path}: no requests")
    return requests


def _prompt_ids(tokenizer, req: dict[str, Any], chat: bool) -> list[int]:
    from kvrelay.core.tokenizer import ChatTemplateError

    where = f"request {req['id']!r}"
    try:
        if req["messages"] is not None:
            if not isinstance(req["messages"], list):
                raise CLIInputError(f"{where}: 'messages' must be a list of objects")
            return tokenizer.apply_chat_template(req["messages"])
        prompt = req["prompt"]
        if isinstance(prompt, list):
            return prompt
        if not isinstance(prompt, str):
            raise CLIInputError(f"{where}: 'prompt' must be a string or a list of token ids")
        if chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        # as the server's completions (and vLLM's): special tokens added (Gemma's BOS)
        return tokenizer.encode(prompt, add_special_tokens=True)
    except ChatTemplateError as exc:
        raise CLIInputError(f"{where}: {exc}") from exc


def _chat_template(value: str | None) -> str | None:
    """The text of --chat-template (None: the model's own); CLIInputError naming the file."""
    from kvrelay.core.tokenizer import ChatTemplateError, read_chat_template

    if value is None:
        return None
    try:
        return read_chat_template(value)
    except ChatTemplateError as exc:
        raise CLIInputError(f"--chat-template: {exc}") from exc


def _sampling(req: dict[str, Any], model_defaults: dict[str, Any]):
    """The request's SamplingParams: its own fields (flags, batch line) over the model's
    defaults over SamplingParams' (OpenAI's), as the ingress applies them."""
    from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams

    fields = {"max_tokens": DEFAULT_MAX_TOKENS, **model_defaults, **req["sampling"]}
    try:
        return SamplingParams.from_dict(fields).validate()
    except (InvalidSamplingParams, TypeError) as exc:
        raise CLIInputError(f"request {req['id']!r}: {exc}") from exc


def speculation_stats(metrics: dict[str, Any], tokens: int, steps: int) -> dict[str, Any]:
    """A finished request's speculative decoding: draft tokens verified, how many were
    accepted, their ratio (None without drafts) and output tokens per step that sampled."""
    drafted = int(metrics.get("num_draft_tokens") or 0)
    accepted = int(metrics.get("num_accepted_tokens") or 0)
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "tokens_per_step": round(tokens / steps, 4) if steps else None,
    }


def _result(
    out, text: str, started: float, first_token: float | None, steps: int = 0
) -> dict[str, Any]:
    end = time.perf_counter()
    n = len(out.output_token_ids)
    return {
        "id": out.request_id,
        "token_ids": out.output_token_ids,
        "text": text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": out.num_cached_tokens,
        "timings": {
            "ttft_s": round((first_token or end) - started, 4),
            "total_s": round(end - started, 4),
            "decode_tok_s": round((n - 1) / (end - first_token), 2)
            if first_token and n > 1 and end > first_token
            else None,
        },
        "speculation": speculation_stats(out.metrics, n, steps),
    }


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.batch_file is None):
        raise CLIInputError("give a PROMPT or --batch-file (exactly one)")
    defaults = _flag_sampling(args)
    if args.batch_file is not None:
        requests = _read_batch(args.batch_file, defaults)
    else:
        requests = [
            {
                "id": "generate-0",
                "prompt": args.prompt,
                "messages": None,
                "sampling": defaults,
                "line": None,
            }
        ]
    for req in requests:  # checked before torch and the model load, so a bad flag fails at once
        _sampling(req, {})
    template = _chat_template(args.chat_template)
    from kvrelay.core.config import ConfigError, from_env
    from kvrelay.core.modelref import ModelNotFoundError, model_generation_defaults
    from kvrelay.workers.config import (
        DEPRECATED_SECTIONS,
        SECTION,
        check_speculation,
        engine_env_names,
    )
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.errors import EngineError, InvalidRequestError

    try:
        # the worker's spelling (KVRELAY_WORKER_*), KVRELAY_ENGINE_* deprecated
        config = from_env(
            EngineConfig,
            SECTION,
            deprecated=DEPRECATED_SECTIONS,
            env_names=engine_env_names(),
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_threads=args.num_threads,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            attention_precision=args.attention_precision,
            **{name: getattr(args, name) for name in SPECULATION_FIELDS},
        )
        check_speculation(
            config.speculation,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.draft_model,
        )
        engine = Engine(config)
    except (ModelNotFoundError, ConfigError, EngineError) as exc:
        raise CLIInputError(" ".join(str(exc).split()) or "model not found") from exc
    model_defaults = model_generation_defaults(engine.loaded.dir, engine.model_name).to_dict()
    tokenizer = engine.tokenizer
    if template is not None:
        tokenizer = tokenizer.with_chat_template(template)
    started = time.perf_counter()
    for req in requests:
        ids = _prompt_ids(tokenizer, req, args.chat)
        try:
            engine.add_request(req["id"], ids, _sampling(req, model_defaults))
        except InvalidRequestError as exc:
            raise CLIInputError(f"request {req['id']!r}: {exc}") from exc
    stream = not args.json and len(requests) == 1
    texts: dict[str, list[str]] = {r["id"]: [] for r in requests}
    first: dict[str, float] = {}
    steps: dict[str, int] = {}  # steps that gave the request tokens
    lines = {r["id"]: r["line"] for r in requests}
    done: dict[str, str] = {}  # finished, not printed yet: results come out in input order
    order = iter(requests)
    waiting: dict[str, Any] | None = next(order)
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.new_token_ids:
                steps[out.request_id] = steps.get(out.request_id, 0) + 1
            texts[out.request_id].append(out.text_delta)
            if stream and out.text_delta:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            if out.finished or out.handoff:
                text = "".join(texts.pop(out.request_id))
                line = lines[out.request_id]
                done[out.request_id] = _report(
                    out, text, line, args, stream, started, first, steps.get(out.request_id, 0)
                )
        while waiting is not None and waiting["id"] in done:
            print(done.pop(waiting["id"]), flush=True)
            waiting = next(order, None)
    return 0


def _report(
    out,
    text: str,
    line: int | None,
    args: argparse.Namespace,
    streamed: bool,
    started: float,
    first: dict[str, float],
    steps: int = 0,
) -> str:
    """The line printed for a finished request (after its streamed text: the newline); a JSON
    result of a batch file names the file's line the request came from."""
    if args.json:
        result = _result(out, text, started, first.get(out.request_id), steps)
        if line is not None:
            result = {"id": result.pop("id"), "line": line, **result}
        return json.dumps(result, ensure_ascii=False)
    if streamed:
        return ""
    return f"[{out.request_id}] {text}"
