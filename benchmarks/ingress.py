"""Ingress overhead at concurrency 1: per-stage medians over sequential chat requests.

Real pieces: valkey-server, the SmolLM2 tokenizer, the Starlette/Uvicorn ingress over TCP, and a
stand-in worker per stream (stream:prefill, stream:decode) with no model that runs the workers'
own queue path: `Streams.read`, the admit script, and an `Emitter` writing every chunk through
the step script (progress tail, out:{id}, the ingress's feed). It answers each task at once,
all its tokens (no hand-off), so everything measured is ingress + Redis. Stages are timed by
wrapping the ingress's own functions with time.perf_counter (one clock for server, worker and
client).

    python benchmarks/ingress.py [--requests 200] [--tokens 16] [--fill-keys 20000]

Prints one JSON line, then a table of medians in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import redis
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ValkeyServer, free_port  # noqa: E402

from kvrelay.core import record as rec  # noqa: E402
from kvrelay.core.enums import FinishReason, RequestStatus, Stage  # noqa: E402
from kvrelay.core.keys import DECODE_GROUP, PREFILL_GROUP, Keys  # noqa: E402
from kvrelay.core.messages import DecodeTask, PrefillTask, Task, TokenChunk  # noqa: E402
from kvrelay.core.modelref import DEFAULT_MODEL  # noqa: E402
from kvrelay.core.record import RequestRecord  # noqa: E402
from kvrelay.pipeline.queue import submit  # noqa: E402
from kvrelay.pipeline.queue.streams import Streams  # noqa: E402
from kvrelay.pipeline.server import routes as ingress_routes  # noqa: E402
from kvrelay.pipeline.server import submission as ingress_submission  # noqa: E402
from kvrelay.pipeline.server.app import create_app  # noqa: E402
from kvrelay.pipeline.server.config import IngressConfig  # noqa: E402
from kvrelay.workers.emitter import Emitter, Inflight, Outgoing, OutgoingKind  # noqa: E402

MODEL_INFO = {"fingerprint": "f" * 32, "page_size": 16, "max_model_len": 8192, "vocab_size": 49152}
# ~150 tokens with SmolLM2's chat template
SYSTEM = "You are a helpful assistant who answers questions about distributed systems briefly."
USER = (
    "Explain how a disaggregated LLM serving system splits prefill and decode across "
    "workers, why the KV cache pages need to be transferred between them, and what the "
    "trade-offs are when the prompt is short versus long. Mention how a page directory in "
    "Redis helps the router decide whether a prompt is mostly cached already, and give a "
    "short example with numbers for a prompt of about one hundred and fifty tokens."
)

T: dict[str, dict[str, float]] = {}  # request id -> stage name -> perf_counter
NEXT_ID = [""]


def mark(rid: str, name: str) -> None:
    T.setdefault(rid, {})[name] = time.perf_counter()


def instrument(app) -> None:
    """Wrap the ingress's stages so each records its start/end time per request."""
    ing = app.state.ingress
    current: dict[str, str] = {}

    def timed_async(obj, attr, name, rid_of=None):
        fn = getattr(obj, attr)

        async def wrapper(*a, **kw):
            rid = current.get("rid", "?")
            mark(rid, name + "<")
            try:
                return await fn(*a, **kw)
            finally:
                mark(rid, name + ">")

        setattr(obj, attr, wrapper)

    def timed_sync(obj, attr, name):
        fn = getattr(obj, attr)

        def wrapper(*a, **kw):
            rid = current.get("rid", "?")
            mark(rid, name + "<")
            try:
                return fn(*a, **kw)
            finally:
                mark(rid, name + ">")

        setattr(obj, attr, wrapper)

    endpoints = type(ing.generation)  # GenerationApi: its routes call self._generate
    gen = endpoints._generate
    # the client picks the id the ingress "generates", so it need not send X-Request-Id
    # (which costs the ingress an extra EXISTS)
    ingress_routes.new_request_id = lambda prefix="req": NEXT_ID[0]

    async def generate(self, request, api):
        rid = NEXT_ID[0]
        current["rid"] = rid
        mark(rid, "handler<")
        return await gen(self, request, api)

    endpoints._generate = generate
    timed_async(ingress_submission, "read_json", "read_json")
    timed_sync(ingress_routes, "parse_chat", "parse")
    timed_async(ing.backpressure, "admit", "backpressure")
    timed_async(ing.registry, "get", "registry")
    timed_sync(submit, "tokenize", "tokenize")
    timed_async(ing.router, "route", "route")
    timed_async(ing.producer, "_submit", "submit_lua")


def worker(url: str, keys: Keys, stage: Stage, tokens: int, stop: threading.Event) -> None:
    """Answer every task of one stream at once as a worker writes: admitted (this consumer
    owns it), one chunk per token, then the final chunk ending the request, all through the
    emitter's step script calls (the token chunks, queued at once, go as one merged chunk)."""
    r = redis.Redis.from_url(url)
    if stage == Stage.PREFILL:
        stream, group, kind = keys.prefill_stream, PREFILL_GROUP, PrefillTask
    else:
        stream, group, kind = keys.decode_stream, DECODE_GROUP, DecodeTask
    streams = Streams(r, keys, f"{stage}-1")
    # the first beat registers the consumer (a step from an unregistered one is refused);
    # nothing here claims entries, so one beat will do
    streams.beat(keys.worker(f"{stage}-1"), {"name": f"{stage}-1"}, 600)
    inflight = Inflight()
    emitter = Emitter(streams, stream, group, inflight)
    emitter.thread.start()
    while not stop.is_set():
        for entry in streams.read(stream, group, 1, 100):
            task: Task = kind.decode(entry.payload or b"")
            rid, eid = task.request_id, entry.entry_id
            mark(rid, "worker_took")
            admitted = RequestRecord(
                status=RequestStatus.DECODING, stage=stage, owner=f"{stage}-1", started=time.time()
            )
            [found] = streams.admit(
                [(eid, rid, 0, admitted.changes(places={rec.STARTED: rec.MILLIS}))]
            )
            inflight.add(rid, eid)
            emitter.follow(rid, found.feeds)  # the ingress's feed, as a worker's reader does
            for i in range(tokens):
                if i == 0:
                    mark(rid, "first_emit")
                chunk = TokenChunk(index=i, token_ids=[42], text="a")
                emitter.put(Outgoing(OutgoingKind.EMIT, rid, eid, chunk=chunk))
            n = len(task.prompt_token_ids)
            usage = {"prompt_tokens": n, "completion_tokens": tokens, "cached_tokens": 0}
            final = TokenChunk(index=tokens, finish_reason=FinishReason.LENGTH, usage=usage)
            ending = RequestRecord(
                status=RequestStatus.FINISHED, finish_reason=FinishReason.LENGTH, cached_tokens=0
            )
            mark(rid, "final_emit")
            emitter.put(
                Outgoing(
                    OutgoingKind.EMIT, rid, eid, chunk=final, req_fields=ending.changes(), done=True
                )
            )
    emitter.close()
    lost = [emitter.lost.get_nowait() for _ in range(emitter.lost.qsize())]
    if lost:
        raise RuntimeError(f"{stage} stand-in: writes refused for {lost}")
    r.close()


def run_client(port: int, n: int, stream: bool, gap_s: float) -> list[dict[str, float]]:
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        "max_tokens": 32,
        "stream": stream,
    }
    payload = json.dumps(body).encode()
    rows = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for i in range(n + 5):  # 5 warm-up requests
            rid = f"bench-{uuid.uuid4().hex[:12]}"
            headers = {"content-type": "application/json"}
            NEXT_ID[0] = rid
            mark(rid, "send")
            with client.stream(
                "POST", "/v1/chat/completions", content=payload, headers=headers
            ) as resp:
                first = True
                for data in resp.iter_raw():
                    if first and stream and b'"content":"a' in data:  # (one a or more)
                        mark(rid, "first_bytes")
                        first = False
                mark(rid, "done")
                assert resp.status_code == 200, resp.status_code
                assert resp.headers["x-request-id"] == rid
            if i >= 5:
                rows.append(T[rid])
            time.sleep(gap_s)
    return rows


STAGES = [
    ("client send -> handler", "send", "handler<"),
    ("read_json", "read_json<", "read_json>"),
    ("parse", "parse<", "parse>"),
    ("backpressure", "backpressure<", "backpressure>"),
    ("registry", "registry<", "registry>"),
    ("tokenize", "tokenize<", "tokenize>"),
    ("route", "route<", "route>"),
    ("submit lua", "submit_lua<", "submit_lua>"),
    ("handler -> queued (ingress)", "handler<", "submit_lua>"),
    ("queued -> worker took", "submit_lua>", "worker_took"),
    ("first emit -> first bytes", "first_emit", "first_bytes"),
    ("final emit -> done", "final_emit", "done"),
    ("send -> first bytes (TTFT)", "send", "first_bytes"),
    ("send -> done", "send", "done"),
]


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for label, a, b in STAGES:
        vals = [(r[b] - r[a]) * 1000 for r in rows if a in r and b in r]
        if vals:
            out[label] = round(statistics.median(vals), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tokens", type=int, default=16, help="tokens each stand-in answer has")
    p.add_argument(
        "--state-refresh-s",
        type=float,
        default=0.05,
        help="ingress snapshot TTL; with --gap-ms this is the default config (0.25 s) with "
        "~1 s between requests (real generation times), scaled down 5x to run faster",
    )
    p.add_argument(
        "--gap-ms",
        type=float,
        default=250.0,
        help="pause between requests: with real generation times requests are this far "
        "apart, so the ingress finds its snapshots stale",
    )
    p.add_argument("--fill-keys", type=int, default=20000, help="extra keys (a real keyspace)")
    args = p.parse_args()
    from kvrelay.core import modelref
    from kvrelay.core.tokenizer import Tokenizer

    ref = modelref.resolve_model(DEFAULT_MODEL)
    tok = Tokenizer.from_dir(modelref.converted_dir(ref))
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(Path(tmp))
        server.start()
        try:
            result = bench(server.url, tok, args)
        finally:
            server.stop()
    print(json.dumps({"benchmark": "ingress", **result}))
    print(f"{'stage (median ms)':34} {'stream':>9} {'json':>9}")
    for label, _, _ in STAGES:
        s, j = result["stream"].get(label), result["json"].get(label)
        fmt = lambda v: f"{v:9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{label:34} {fmt(s)} {fmt(j)}")


def bench(url: str, tok, args) -> dict:
    keys = Keys("bench:")
    r = redis.Redis.from_url(url)
    r.hset(keys.models, DEFAULT_MODEL, json.dumps(MODEL_INFO))
    for wid, role in (("p1", "prefill"), ("d1", "decode")):
        r.hset(keys.worker(wid), mapping={"role": role, "model": DEFAULT_MODEL, "pid": 1})
    pipe = r.pipeline(transaction=False)
    for i in range(args.fill_keys):
        pipe.set(f"fill:{i}", b"x")
    pipe.execute()
    n_prompt = len(
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        )
    )
    port = free_port()
    config = IngressConfig(
        redis_url=url,
        key_prefix="bench:",
        models=(DEFAULT_MODEL,),
        port=port,
        state_refresh_s=args.state_refresh_s,
    )
    app = create_app(config, tokenizers={DEFAULT_MODEL: tok})
    instrument(app)
    srv = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    stop = threading.Event()
    r.xgroup_create(keys.prefill_stream, PREFILL_GROUP, id="0", mkstream=True)
    r.xgroup_create(keys.decode_stream, DECODE_GROUP, id="0", mkstream=True)
    workers = [
        threading.Thread(target=worker, args=(url, keys, s, args.tokens, stop), daemon=True)
        for s in (Stage.PREFILL, Stage.DECODE)
    ]
    for wk in workers:
        wk.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        res = {"prompt_tokens": n_prompt, "requests": args.requests, "tokens": args.tokens}
        res["stream"] = summarize(run_client(port, args.requests, True, args.gap_ms / 1000))
        res["json"] = summarize(run_client(port, args.requests, False, args.gap_ms / 1000))
    finally:
        stop.set()
        srv.should_exit = True
        th.join(5)
        for wk in workers:
            wk.join(5)
        r.close()
    return res


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
