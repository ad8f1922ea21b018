"""`kvrelay up` / `kvrelay down`: the whole stack on one host under supervisord.

Programs: valkey (embedded, append-only, unless --redis-url; N cluster nodes with --shards N,
and R replica nodes per primary with --valkey-replicas R: `kvrelay.cli.up.valkey`), one store
node, the ingress, N prefill and M decode workers (chosen for the host unless given:
`kvrelay.cli.up.topology`).
The model is prepared (converted) once before any worker starts, and the host's cores are
divided between the workers so they do not oversubscribe the CPU. With several models
(`--model A --model B`), each gets its own store node and N + M workers on its own pipeline
(`kvrelay.cli.up.models`), and the cores are divided between all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.cli.errors import EXIT_FAILURE, EXIT_UNAVAILABLE, CommandError
from kvrelay.cli.serve import SERVE_FLAGS
from kvrelay.cli.up.launch import Program, Supervisor, check_port_free, read_state
from kvrelay.cli.up.models import (
    ServedModel,
    per_model,
    plan_models,
    served_name_items,
    state_stores,
)
from kvrelay.cli.up.progress import UpProgress
from kvrelay.cli.up.ready import CrashLoopError, check_redis, wait_ready
from kvrelay.cli.up.topology import (
    MAX_INGRESSES,
    STANDBY_SUFFIX,
    Topology,
    choose,
    default_weights,
    ingress_names,
)
from kvrelay.cli.up.valkey import check_ports_free, check_shards, embedded_valkey, start_cluster
from kvrelay.cli.up.valkey_cluster import MAX_SHARDS, NODE_TIMEOUT_MS, ClusterError
from kvrelay.cli.up.valkey_sentinel import add_replica_arguments
from kvrelay.cli.worker import KV_DTYPE_CHOICES, SPECULATION_CHOICES
from kvrelay.core.config import (
    DEFAULT_KEY_PREFIX,
    ConfigError,
    check_redis_url,
    env_name,
    read_config_file,
    setting,
)
from kvrelay.core.enums import Quantization, Speculation
from kvrelay.core.modelref import (
    ATTENTION_PRECISIONS,
    DEFAULT_MODEL,
    QUANTIZATIONS,
    SHORT_DTYPE_NAMES,
)
from kvrelay.kvstore.config import SECTION as STORE_SECTION
from kvrelay.kvstore.config import StoreConfig
from kvrelay.pipeline.queue.route import RouteMode
from kvrelay.pipeline.server.config import MODES, IngressConfig
from kvrelay.pipeline.server.config import SECTION as INGRESS_SECTION

if TYPE_CHECKING:  # loaded where the workers' settings are checked
    from kvrelay.workers.config import WorkerConfig

DEFAULT_RUN_DIR = "kvrelay-run"
MODE_ENV = env_name(INGRESS_SECTION, "mode")  # KVRELAY_INGRESS_MODE
# `kvrelay serve`'s limit flags, passed through to the ingress as they are: one definition, so
# `up` cannot drift from `serve`; connection flags stay `up`'s own (it binds and wires them).
INGRESS_FLAGS = [
    f for f in SERVE_FLAGS if f[1] not in ("redis_url", "key_prefix", "shards", "host", "port")
]


def _number(kind: type, low: float, high: float | None = None, what: str = "value"):
    """An argparse type: `kind` within [low, high], else a one-line usage error (exit 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low}-{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {bounds}, got {text}")
        return value

    return parse


def _env_item(text: str) -> str:
    key, sep, _value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {text!r}")
    return text


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    count, size = _number(int, 0, what="count"), _number(int, 1, what="size")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="model name or path (repeatable: each model gets its own workers, store node and "
        "streams; default: the --config file's [ingress] models, else smollm2-135m-instruct)",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML settings file for every program (`kvrelay serve|worker|store --config`); "
        "its [ingress] models are the models to serve when no --model is given",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the API serves the model under (vLLM's flag): the first in responses "
        "and /v1/models, requests naming any route to it; with several models "
        "MODEL=NAME[,NAME] (repeatable)",
    )
    p.add_argument(
        "--chat-template",
        action="append",
        default=None,
        metavar="[MODEL=]FILE",
        help="the model's chat template instead of its own (vLLM's flag): a Jinja file or the "
        "template text; with several models MODEL=FILE (repeatable)",
    )
    p.add_argument(
        "--prefill",
        type=count,
        default=None,
        help="prefill workers per model (default: chosen for the host)",
    )
    p.add_argument(
        "--decode",
        type=count,
        default=None,
        help="decode workers per model (default: chosen for the host)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="a warm standby per worker: a second process of the same name, loaded, that "
        "serves within milliseconds of the first's death (twice the workers' memory)",
    )
    p.add_argument("--host", default="127.0.0.1", help="ingress bind address")
    p.add_argument(
        "--ingresses",
        type=_number(int, 1, MAX_INGRESSES, "number of ingresses"),
        default=1,
        help="ingress processes sharing --host:--port (SO_REUSEPORT: the kernel spreads the "
        "connections; a killed one's clients reconnect to another); default 1",
    )
    p.add_argument(
        "--port", type=_number(int, 1, 65535, "port"), default=8000, help="ingress port (8000)"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="ingress routing (default auto; colocated with --prefill 0)",
    )
    p.add_argument(
        "--run-dir", default=DEFAULT_RUN_DIR, help="config, logs, data (default ./kvrelay-run)"
    )
    p.add_argument("--redis-url", default=None, help="use this Redis instead of embedded Valkey")
    p.add_argument(
        "--redis-port",
        type=_number(int, 0, 65535, "port"),
        default=0,
        help="embedded Valkey port (0: a free port); with --shards N the first of N",
    )
    p.add_argument(
        "--shards",
        type=_number(int, 1, MAX_SHARDS, "shard count"),
        default=1,
        help="pipeline shards: 1 (default) a plain Valkey, 2-16 a local Valkey Cluster of that "
        "many primaries, one shard's keys on each; with --redis-url, the shards on that server",
    )
    add_replica_arguments(p, _number(int, 0, 16, "replica count"), _number(int, 100, 600000))
    p.add_argument(
        "--cluster-node-timeout-ms",
        type=_number(int, 100, 600000),
        default=NODE_TIMEOUT_MS,
        help="with --shards 3+ and --valkey-replicas: the cluster's node timeout, after which a "
        f"silent primary's replica is promoted ({NODE_TIMEOUT_MS})",
    )
    p.add_argument("--key-prefix", default=DEFAULT_KEY_PREFIX, help="Redis key prefix")
    p.add_argument("--threads", type=size, default=None, help="cores to divide (default: all)")
    p.add_argument("--arena-bytes", type=size, default=1 << 30, help="store host-tier bytes")
    p.add_argument("--disk-bytes", type=count, default=8 << 30, help="store disk-tier bytes")
    p.add_argument("--kv-cache-bytes", type=size, default=None, help="per-worker KV pool bytes")
    p.add_argument(
        "--quantization",
        choices=("auto", *QUANTIZATIONS),
        default="auto",
        help="worker weights: auto (w8a16 on AMX hosts, int8-weight-only on other x86-64 CPU "
        "hosts, else the model's), none (model dtype), w8a16, q8_0, int8-weight-only, fp16 or "
        "int8 (CPU only; see docs/benchmarks.md)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPE_CHOICES,
        default="auto",
        metavar="{auto,fp32,bf16,fp16}",
        help="worker KV page dtype: auto (bf16, or fp32 on CPUs without the C++ kernels), "
        "fp32, bf16 or fp16; resolved once here, the store expects the same pages",
    )
    p.add_argument(
        "--attention-precision",
        choices=ATTENTION_PRECISIONS,
        default="auto",
        help="worker attention dot products: auto (bf16 on AMX-BF16 CPUs with bf16 pages, "
        "else fp32), fp32, or bf16 (q and p rounded to bf16 on AMX tiles); resolved once "
        "here, the store expects the same pages",
    )
    p.add_argument(
        "--speculation",
        choices=SPECULATION_CHOICES,
        default=None,
        help="speculative decoding on the workers, never changing the output: auto (draft "
        "with --draft-model, else ngram), off, ngram (prompt lookup) or draft (default: the "
        "workers' default, auto; KVRELAY_WORKER_SPECULATION)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=size,
        default=None,
        metavar="K",
        help="the longest draft a worker verifies in one step (default 6)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="NAME",
        help="draft model name or path, with the model's tokenizer; prepared here like --model",
    )
    p.add_argument("--detach", action="store_true", help="return once the stack is ready")
    p.add_argument(
        "--timeout",
        type=_number(float, 0.1, what="number of seconds"),
        default=600.0,
        help="seconds to wait for readiness",
    )
    p.add_argument(
        "--env",
        action="append",
        type=_env_item,
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every program (repeatable)",
    )
    limits = p.add_argument_group(
        "ingress settings (as `kvrelay serve`; default: its defaults; "
        "--override-generation-config goes to the workers too)"
    )
    for flag, dest, kind, help_text in INGRESS_FLAGS:
        limits.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)


def resolve_models(args: argparse.Namespace) -> list[str]:
    """The models to serve, in order (once): `--model` (repeatable), else the `--config`
    file's `models` (its `[ingress]` table or top level), else the default model. Sets
    `args.models` and `args.model` (the first)."""
    models = getattr(args, "models", None)
    if models:
        return models
    given = args.model
    if isinstance(given, str):
        given = [given]
    if not given:
        try:
            values = read_config_file(getattr(args, "config", None), INGRESS_SECTION)
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        listed = values.get("models") or [DEFAULT_MODEL]
        if isinstance(listed, str):
            listed = [listed]
        if not isinstance(listed, list) or not all(isinstance(m, str) and m for m in listed):
            raise CommandError(
                f"models in {args.config} must be a list of model names or paths, got {listed!r}"
            )
        given = listed
    args.models, args.model = list(given), given[0]
    return args.models


MODEL_TABLE = "model"  # the --config file's [model."MODEL"] tables
MODEL_TABLE_KEYS = ("chat_template", "served_model_name")


def model_settings(args: argparse.Namespace) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per given model: its served names and chat template, flags over the `--config` file's
    `[model."MODEL"]` tables (CommandError, exit 2, for an ambiguous or unknown model)."""
    models = resolve_models(args)
    names, templates = _file_model_settings(getattr(args, "config", None), models)
    try:
        names.update(served_name_items(getattr(args, "served_model_name", None) or [], models))
        templates.update(
            per_model(getattr(args, "chat_template", None) or [], models, "--chat-template")
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return names, templates


def _file_model_settings(
    config: str | None, models: list[str]
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """`chat_template` and `served_model_name` of the config file's `[model."MODEL"]` tables
    (a relative template path is the file's neighbour)."""
    import tomllib

    from kvrelay.core.tokenizer import is_file

    if config is None:
        return {}, {}
    try:
        with open(config, "rb") as fh:
            tables = tomllib.load(fh).get(MODEL_TABLE, {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}, {}  # read_config_file says why (resolve_models, the programs)
    names: dict[str, list[str]] = {}
    templates: dict[str, str] = {}
    where = f"--config {config}"
    if not isinstance(tables, dict):
        raise CommandError(f'{where}: [{MODEL_TABLE}."MODEL"] must be tables')
    for key, table in tables.items():
        try:
            model = next(iter(per_model([f"{key}=-"], models, f"[{MODEL_TABLE}.{key!r}]")))
        except ValueError:
            raise CommandError(
                f"{where}: [{MODEL_TABLE}.{key!r}] names no served model ({', '.join(models)})"
            ) from None
        if not isinstance(table, dict) or set(table) - set(MODEL_TABLE_KEYS):
            raise CommandError(
                f"{where}: [{MODEL_TABLE}.{key!r}] takes only {', '.join(MODEL_TABLE_KEYS)}"
            )
        served = table.get("served_model_name")
        if isinstance(served, str):
            served = [served]
        if served is not None:
            if not isinstance(served, list) or not all(isinstance(n, str) and n for n in served):
                raise CommandError(
                    f"{where}: [{MODEL_TABLE}.{key!r}] served_model_name must be a name or a "
                    "list of names"
                )
            names[model] = served
        template = table.get("chat_template")
        if template is not None:
            if not isinstance(template, str) or not template:
                raise CommandError(
                    f"{where}: [{MODEL_TABLE}.{key!r}] chat_template must be a file or the text"
                )
            beside = Path(config).resolve().parent / template
            templates[model] = str(beside) if is_file(beside) else template
    return names, templates


def served_models(args: argparse.Namespace, run_dir: Path, store_node: str) -> list[ServedModel]:
    """Each model's pipeline, store node, worker names, served names and chat template
    (CommandError, exit 2, for two names of one model, two models whose pipelines would clash
    or a served name given twice)."""
    topo = resolve_topology(args)
    names, templates = model_settings(args)
    try:
        return plan_models(
            resolve_models(args), run_dir, store_node, topo.prefill, topo.decode, names, templates
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def check_chat_templates(served: list[ServedModel]) -> dict[str, str]:
    """Served name -> the text of each model's --chat-template; CommandError naming the file
    when one is missing or does not compile."""
    from kvrelay.core.tokenizer import ChatTemplateError, read_chat_template

    out = {}
    for m in served:
        if m.chat_template:
            try:
                out[m.served] = read_chat_template(m.chat_template)
            except ChatTemplateError as exc:
                raise CommandError(f"--chat-template: {exc}") from None
    return out


def extra_env(args: argparse.Namespace) -> dict[str, str]:
    """The `--env KEY=VALUE` items (checked by argparse) as a dict; a later KEY wins."""
    return dict(item.partition("=")[::2] for item in args.env)


def env_mode(env: dict[str, str]) -> str | None:
    """The ingress mode the `--env` items give (KVRELAY_INGRESS_MODE), None when they don't."""
    return setting(IngressConfig, "mode", INGRESS_SECTION, env, default=None)


# `up`'s speculation flags -> the workers' variables (the workers read and check them)
SPECULATION_ENV = {
    "speculation": "KVRELAY_WORKER_SPECULATION",
    "num_speculative_tokens": "KVRELAY_WORKER_NUM_SPECULATIVE_TOKENS",
    "draft_model": "KVRELAY_WORKER_DRAFT_MODEL",
}


def speculation_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' variables for the speculation flags given to `up` (none: theirs)."""
    out = {}
    for dest, var in SPECULATION_ENV.items():
        value = getattr(args, dest, None)
        if value is not None:
            out[var] = str(value)
    return out


def check_worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The workers' settings as they will read them (flags, then --env, over this process's
    environment); CommandError (exit 2) for a value they cannot parse or speculation settings
    they would refuse, before launching. (Other settings are the workers' to check: a worker
    that refuses them crash-loops, and `up` fails with its log.)"""
    from kvrelay.core.config import ConfigError, from_env
    from kvrelay.workers.config import SECTION, WorkerConfig

    env = {**os.environ, **speculation_env(args), **extra_env(args)}
    try:
        config = from_env(WorkerConfig, SECTION, environ=env)
        speculation_mode(config)
    except ConfigError as exc:
        raise CommandError(f"workers: {exc}") from None
    return config


def speculation_mode(config: WorkerConfig) -> str:
    """The workers' speculation, resolved (off, ngram or draft); ConfigError when refused."""
    from kvrelay.workers.config import check_speculation

    engine = config.engine
    return check_speculation(
        engine.speculation,
        engine.num_speculative_tokens,
        engine.prompt_lookup_min,
        engine.prompt_lookup_max,
        engine.draft_model,
    )


def ingress_flags(args: argparse.Namespace) -> list[str]:
    """The `kvrelay serve` arguments for the ingress limits given to `up`."""
    out: list[str] = []
    for flag, dest, _kind, _help in INGRESS_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            if dest == "api_keys_file":  # read by the ingress, which runs elsewhere
                value = os.path.abspath(value)
            out += [flag, str(value)]
    return out


def check_ingress_config(args: argparse.Namespace, mode: str) -> None:
    """Refuse ingress limits the ingress would refuse (CommandError, exit 2) before launching."""
    from kvrelay.core.config import ConfigError
    from kvrelay.pipeline.server.config import load_config

    env = dict(os.environ, **extra_env(args))
    overrides = {dest: getattr(args, dest, None) for _f, dest, _k, _h in INGRESS_FLAGS}
    try:
        load_config(environ=env, mode=mode, **overrides)
    except ConfigError as exc:
        raise CommandError(f"ingress: {exc}") from None


def add_down_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory of the stack")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the stop")


def _num_gpus() -> int:
    """NVIDIA GPUs of this host (torch-free: the driver's proc entries, else its device files;
    CUDA_VISIBLE_DEVICES narrows them)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        count = len(list(gpus.iterdir()))
    else:
        count = sum(1 for d in Path("/dev").glob("nvidia[0-9]*") if d.name[6:].isdigit())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # CUDA's variable, not a kvrelay setting
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))
    return count


def resolve_quantization(args: argparse.Namespace) -> str:
    """The workers' weights: --quantization, or for `auto` what the host runs fastest."""
    if args.quantization == "auto":
        args.quantization, args.quantization_why = default_weights(resolve_topology(args).gpus)
    elif args.quantization == Quantization.W8A16:
        from kvrelay.kernels import loaded_isa, w8a16_available

        if not w8a16_available():
            raise CommandError(
                "--quantization w8a16 needs AMX-BF16 tiles (the amx kernel variant); this host "
                f"runs the {loaded_isa() or 'torch'} kernels: use q8_0 or int8-weight-only"
            )
    return args.quantization


def resolve_topology(args: argparse.Namespace) -> Topology:
    """Fill in --prefill/--decode for the host (once) and return the topology."""
    topo = getattr(args, "topology", None)
    if topo is not None:
        return topo
    env = extra_env(args)
    asked = args.mode or env_mode(env)
    topo = choose(
        args.threads or os.cpu_count() or 1,
        _num_gpus(),
        args.prefill,
        args.decode,
        wants_prefill=asked in (RouteMode.AUTO, RouteMode.DISAGGREGATED),
        models=len(resolve_models(args)),
    )
    args.prefill, args.decode, args.topology = topo.prefill, topo.decode, topo
    return topo


def ingress_mode(args: argparse.Namespace) -> str:
    """The ingress routing mode for these `up` arguments (CommandError when they disagree)."""
    resolve_topology(args)
    env = extra_env(args)
    given = env_mode(env)
    mode = args.mode or given or (RouteMode.COLOCATED if args.prefill == 0 else RouteMode.AUTO)
    if args.mode and given is not None and given != args.mode:
        raise CommandError(f"--mode {args.mode} disagrees with --env {MODE_ENV}={given}")
    if mode not in MODES:
        raise CommandError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    if args.prefill == 0 and mode != RouteMode.COLOCATED:
        raise CommandError(f"--prefill 0 needs mode colocated (no prefill worker), got {mode}")
    return mode


def resolve_kv_cache_dtype(
    args: argparse.Namespace, env: dict[str, str], model_dtype: str, device_type: str
) -> str:
    """The workers' KV page dtype name ("bfloat16") for --kv-cache-dtype (or, given `auto`,
    KVRELAY_WORKER_KV_CACHE_DTYPE), `auto` resolved by the workers' own rule
    (loader.resolve_kv_dtype_name): on CPU this loads (builds once) the C++ kernels, unless
    the workers' environment turns them off (KVRELAY_KERNELS_CPU=torch)."""
    from kvrelay.core.config import setting
    from kvrelay.kernels.cpu_build import kernel_settings
    from kvrelay.workers.config import DEPRECATED_SECTIONS, SECTION, WorkerConfig
    from kvrelay.workers.model.loader import resolve_kv_dtype_name

    seen = dict(os.environ, **env)  # what the workers will see
    requested = getattr(args, "kv_cache_dtype", "auto")
    if requested == "auto":
        requested = setting(
            WorkerConfig, "kv_cache_dtype", SECTION, seen, deprecated=DEPRECATED_SECTIONS
        )
    kernels = False if kernel_settings(seen).torch_only else None
    try:
        return resolve_kv_dtype_name(requested, model_dtype, device_type, kernels)
    except ValueError as exc:
        raise CommandError(f"KVRELAY_WORKER_KV_CACHE_DTYPE: {exc}") from None


def resolve_attention(
    args: argparse.Namespace,
    env: dict[str, str],
    kv_dtype: str,
    model_dtype: str,
    device: str,
    model: str | None = None,
) -> str:
    """The workers' attention precision ("fp32" or "bf16") for --attention-precision (or,
    given `auto`, KVRELAY_WORKER_ATTENTION_PRECISION), `auto` resolved by the workers' own rule
    (loader.resolve_attention_precision) for the prepared model's head_dim and page size."""
    from kvrelay.core.modelref import config_head_dim, converted_dir, read_config, resolve_model
    from kvrelay.kernels.cpu_build import kernel_settings
    from kvrelay.workers.config import DEPRECATED_SECTIONS, SECTION, WorkerConfig
    from kvrelay.workers.model.loader import resolve_attention_precision

    seen = dict(os.environ, **env)  # what the workers will see
    requested = getattr(args, "attention_precision", "auto")
    if requested == "auto":
        requested = setting(
            WorkerConfig, "attention_precision", SECTION, seen, deprecated=DEPRECATED_SECTIONS
        )
    page_size = setting(WorkerConfig, "page_size", SECTION, seen, deprecated=DEPRECATED_SECTIONS)
    try:
        model_dir = converted_dir(resolve_model(model or resolve_models(args)[0]))
        head_dim: int | None = config_head_dim(read_config(model_dir))
    except (OSError, ValueError, KeyError):  # not prepared here: the workers check it
        head_dim = None
    available = False if kernel_settings(seen).torch_only else None
    try:
        return resolve_attention_precision(
            requested, kv_dtype, model_dtype, device, page_size, head_dim, available
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def build_programs(args: argparse.Namespace, run_dir: Path) -> tuple[list[Program], dict]:
    """The supervised programs and the stack state for these `up` arguments."""
    py = [sys.executable, "-m", "kvrelay.cli.main"]
    programs: list[Program] = []
    redis_url = args.redis_url
    valkey_state: dict[str, Any] = {}
    if redis_url is None:
        programs, redis_url, valkey_state = embedded_valkey(args, run_dir)
    resolve_models(args)  # sets args.model, the first
    config = getattr(args, "config", None)
    config_flags = ["--config", str(Path(config).resolve())] if config else []
    store_dir = run_dir / "store"
    env = {
        "KVRELAY_REDIS_URL": redis_url,
        "KVRELAY_KEY_PREFIX": args.key_prefix,
        "KVRELAY_SHARDS": str(args.shards),  # one pipeline shard per cluster node
        "KVRELAY_STORE_RUN_DIR": str(store_dir),
        "KVRELAY_STORE_REDIS_URL": redis_url,
        "KVRELAY_STORE_KEY_PREFIX": args.key_prefix,
        "KVRELAY_STORE_MODEL": args.model,
        "KVRELAY_STORE_DISK_DIR": str(store_dir / "disk"),
        "KVRELAY_STORE_ARENA_BYTES": str(args.arena_bytes),
        "KVRELAY_STORE_DISK_BYTES": str(args.disk_bytes),
        "KVRELAY_WORKER_MODEL": args.model,
        "PYTHONUNBUFFERED": "1",
    }
    if args.kv_cache_bytes:
        env["KVRELAY_WORKER_KV_CACHE_BYTES"] = str(args.kv_cache_bytes)
    quantization = resolve_quantization(args)
    # the store must expect the quantized model's fingerprint
    if quantization != Quantization.NONE:
        env["KVRELAY_WORKER_QUANTIZATION"] = quantization
        env["KVRELAY_STORE_QUANTIZATION"] = quantization
    env.update(speculation_env(args))  # decode steps speculate; prefill stops after one token
    env.update(extra_env(args))
    mode = ingress_mode(args)
    topo = resolve_topology(args)
    gpus = topo.gpus
    # The store must expect the workers' pages (their size and fingerprint): `auto` is resolved
    # here, once, and every worker gets the result, so the stack cannot disagree on it.
    model_dtype = "bfloat16" if gpus else "float32"  # the workers' dtype auto
    kv_dtype = resolve_kv_cache_dtype(args, env, model_dtype, "cuda" if gpus else "cpu")
    env["KVRELAY_WORKER_KV_CACHE_DTYPE"] = SHORT_DTYPE_NAMES[kv_dtype]
    env.setdefault("KVRELAY_STORE_DTYPE", kv_dtype)
    device = "cuda" if gpus else "cpu"
    env.setdefault("KVRELAY_STORE_MODEL_DTYPE", model_dtype)
    store_node = setting(StoreConfig, "node_id", STORE_SECTION, env)
    served = served_models(args, run_dir, store_node)
    # the names the API serves: a model's first --served-model-name, else as given
    env["KVRELAY_INGRESS_MODELS"] = ",".join(m.api_name for m in served)
    templates = check_chat_templates(served)
    # Each model has a store node of its own (an arena holds pages of one size and model);
    # the host's store budget is divided between them.
    num_models = len(served)
    arena_bytes, disk_bytes = args.arena_bytes // num_models, args.disk_bytes // num_models
    attention: dict[str, str] = {}
    model_envs: list[dict[str, str]] = []
    for m in served:
        (Path(m.store_run_dir) / "disk").mkdir(parents=True, exist_ok=True)
        attention[m.served] = resolve_attention(args, env, kv_dtype, model_dtype, device, m.given)
        menv = dict(env)
        menv.setdefault("KVRELAY_STORE_ATTENTION_PRECISION", attention[m.served])
        menv["KVRELAY_WORKER_ATTENTION_PRECISION"] = attention[m.served]
        if m.names:
            menv["KVRELAY_WORKER_SERVED_MODEL_NAME"] = ",".join(m.names)
        if m.served in templates:
            # a copy in the run dir: restarted workers publish what `up` checked
            copy = run_dir / f"chat-template{'-' + m.pipeline if m.pipeline else ''}.jinja"
            copy.write_text(templates[m.served])
            menv["KVRELAY_WORKER_CHAT_TEMPLATE"] = str(copy)
        if num_models > 1:
            menv.update(
                {
                    "KVRELAY_STORE_RUN_DIR": m.store_run_dir,
                    "KVRELAY_STORE_MODEL": m.given,
                    "KVRELAY_STORE_DISK_DIR": str(Path(m.store_run_dir) / "disk"),
                    "KVRELAY_STORE_NODE_ID": m.store_node,
                    "KVRELAY_STORE_ARENA_BYTES": str(arena_bytes),
                    "KVRELAY_STORE_DISK_BYTES": str(disk_bytes),
                    "KVRELAY_WORKER_MODEL": m.given,
                    "KVRELAY_WORKER_PIPELINE": m.pipeline,
                }
            )
        model_envs.append(menv)
    for m, menv in zip(served, model_envs, strict=True):
        programs.append(Program(m.store, [*py, "store", *config_flags], env=menv, priority=20))
    first_env = model_envs[0]
    num_ingresses = getattr(args, "ingresses", 1)
    shared = ["--reuse-port"] if num_ingresses > 1 else []  # one address for all of them
    for ingress in ingress_names(num_ingresses):
        programs.append(
            Program(
                ingress,
                [
                    *py,
                    "serve",
                    "--host",
                    args.host,
                    "--port",
                    str(args.port),
                    *shared,
                    *ingress_flags(args),
                    *config_flags,
                ],  # fmt: skip
                env=dict(first_env, **{MODE_ENV: mode}),
                priority=30,
            )
        )
    threads = topo.threads
    # the workers publish the defaults with the model: producers elsewhere apply them too
    override = getattr(args, "override_generation_config", None)
    worker_flags = ["--override-generation-config", override] if override is not None else []
    n = 0
    for m, menv in zip(served, model_envs, strict=True):
        for role, name in m.roles():
            wenv = dict(menv, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            if gpus:
                wenv["CUDA_VISIBLE_DEVICES"] = str(n % gpus)  # one GPU per worker, round robin
            n += 1
            command = [*py, "worker", role, "--name", name, "--threads", str(threads)]
            # a standby: the same worker name; it waits, loaded, for the first one's slot on the
            # host (`workers.slot`) and takes the dead one's entries at once
            standby = getattr(args, "standby", False)
            for program in [name, f"{name}{STANDBY_SUFFIX}"] if standby else [name]:
                programs.append(
                    Program(
                        program,
                        command + worker_flags + config_flags,
                        env=wenv,
                        priority=40,
                        startsecs=2,
                    )
                )
    state = {
        "redis_url": redis_url,
        "key_prefix": args.key_prefix,
        "shards": args.shards,
        "host": args.host,
        "port": args.port,
        "model": args.model,
        "mode": mode,
        "run_dir": str(run_dir),
        "store_run_dir": str(store_dir),
        "threads_per_worker": threads,
        "programs": [p.name for p in programs],
        "store_node": store_node,
        "prefill": args.prefill * num_models,  # all models' workers (what /health counts)
        "decode": args.decode * num_models,
        "topology": topo.to_dict(),
        "quantization": quantization,
        "kv_cache_dtype": SHORT_DTYPE_NAMES[kv_dtype],  # resolved: what the workers hold
        "attention_precision": attention[served[0].served],  # resolved (the first model's)
        "speculation": speculation_mode(check_worker_config(args)),  # resolved
        **valkey_state,
    }
    if getattr(args, "standby", False):  # a `-standby` program beside each worker
        state["standby"] = True
    if num_ingresses > 1:  # their programs: topology.ingress_names
        state["ingresses"] = num_ingresses
    if served[0].names:
        state["served_model_name"] = served[0].names
    if num_models > 1:
        state["models"] = [
            dict(m.to_dict(), attention_precision=attention[m.served]) for m in served
        ]
    if config:
        state["config"] = str(Path(config).resolve())
    if "cluster" in valkey_state:  # started by start_cluster once the cluster is ok
        nodes = len(valkey_state["cluster"]["nodes"])  # replica nodes included
        for prog in programs[nodes:]:
            prog.autostart = False
    return programs, state


def _preflight(args: argparse.Namespace, run_dir: Path) -> None:
    """Refuse, before launching anything, what would make the stack fail or join another one."""
    if args.redis_url is not None:
        check_redis_url(args.redis_url, "--redis-url")  # bad usage: exit 2
    config = getattr(args, "config", None)
    if config is not None and not Path(config).is_file():
        raise CommandError(f"--config: no such file {config}")
    # two names of one model, a served name twice, a bad chat template: bad usage
    check_chat_templates(served_models(args, run_dir, "node0"))
    check_shards(args, run_dir)
    check_ingress_config(args, ingress_mode(args))
    workers = check_worker_config(args)
    if speculation_mode(workers) == Speculation.DRAFT and len(resolve_models(args)) > 1:
        # one draft model for every worker: it must share each model's tokenizer
        raise CommandError(
            "a draft model (--draft-model, speculation draft) needs one model per stack; "
            "with several models use --speculation ngram or off"
        )
    if Supervisor(run_dir).pid() is not None:
        raise CommandError(f"a stack is already running in {run_dir}", EXIT_UNAVAILABLE)
    check_port_free(args.host, args.port)
    if args.redis_url is not None:
        check_redis(args.redis_url)
    else:
        check_ports_free(args)


def run_up(args: argparse.Namespace) -> int:
    if args.decode is not None and args.decode < 1:
        raise CommandError("need --decode >= 1 (and --prefill >= 0)")
    run_dir = Path(args.run_dir).resolve()
    _preflight(args, run_dir)
    from kvrelay.core.modelref import ModelNotFoundError
    from kvrelay.workers.model.loader import prepare_model

    workers = check_worker_config(args)
    # convert once here so workers never race to do it; the draft model too, when they load one
    models: list[tuple[str, str | None]] = [("", name) for name in resolve_models(args)]
    if speculation_mode(workers) == Speculation.DRAFT:
        models.append(("draft model: ", workers.engine.draft_model))
    for what, name in models:
        try:
            prepare_model(name)
        except ModelNotFoundError as exc:
            raise CommandError(f"{what}{exc}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run_dir)
    programs, state = build_programs(args, run_dir)
    sup.write(programs, nodaemon=not args.detach, state=state)
    print(f"kvrelay: topology: {args.topology.describe()}", file=sys.stderr)
    why = getattr(args, "quantization_why", "given")
    print(
        f"kvrelay: weights: {state['quantization']} ({why}); KV pages "
        f"{state['kv_cache_dtype']}, {state['attention_precision']} attention",
        file=sys.stderr,
    )
    progress = UpProgress(state, run_dir / "logs")  # before the start: log sizes of earlier runs
    sup.start(detach=args.detach)
    where = f"http://{args.host}:{args.port}"
    logs = run_dir / "logs"
    try:
        start_cluster(sup, state, args.timeout)  # nothing to do for one plain Valkey
    except (ClusterError, TimeoutError) as exc:
        sup.stop()
        raise CommandError(f"{exc}; stopping. Logs in {logs}", EXIT_FAILURE) from None
    if args.detach:
        try:
            reason = wait_ready(state, args.timeout, sup, progress=progress)
            if reason is not None:
                reason = f"not ready after {args.timeout:g}s ({reason})"
        except CrashLoopError as exc:
            print(f"kvrelay up: {exc}", file=sys.stderr)  # the log's end, before the error line
            reason = "not ready"
        if reason is not None:
            sup.stop()
            _remove_arena(state)
            raise CommandError(f"{reason}; stopping. Logs in {logs}", EXIT_FAILURE)
        print(json.dumps({"ready": True, "url": where, **state}))
        return 0
    try:
        proc = sup.proc
        assert proc is not None  # started in the foreground: a child
        try:
            reason = wait_ready(
                state, args.timeout, sup, alive=lambda: proc.poll() is None, progress=progress
            )
        except CrashLoopError as exc:
            print(f"kvrelay up: {exc}", file=sys.stderr)
            sup.stop()
            raise CommandError(f"not ready; stopping. Logs in {logs}", EXIT_FAILURE) from None
        if reason is None:
            names = ", ".join(m.api_name for m in served_models(args, run_dir, "node0"))
            print(f"kvrelay: serving {names} at {where} (Ctrl-C stops)", file=sys.stderr)
        elif proc.poll() is None:
            print(f"kvrelay up: not ready after {args.timeout:g}s ({reason})", file=sys.stderr)
        return sup.wait()
    except KeyboardInterrupt:
        sup.stop()
        return 130
    finally:
        _remove_arena(state)


def run_down(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    try:
        state = read_state(run_dir)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from None  # a wrong --run-dir is bad usage: exit 2
    except (OSError, ValueError) as exc:  # unreadable or not JSON
        raise CommandError(f"cannot read {run_dir}/stack.json: {exc}") from None
    sup = Supervisor(run_dir)
    pid = sup.pid()
    if pid is None:
        print(f"kvrelay down: nothing running in {run_dir}", file=sys.stderr)
        return 0
    if not sup.stop(args.timeout):
        raise CommandError(f"supervisord still running after {args.timeout:.0f}s", EXIT_FAILURE)
    _remove_arena(state)
    programs = ", ".join(state.get("programs") or []) or "no programs"
    print(f"stopped the stack in {run_dir} (supervisord pid {pid}): {programs}")
    return 0


def _remove_arena(state: dict) -> None:
    """Give the store nodes' shared-memory arenas back (RAM); the disk tiers stay for the next
    `up`."""
    stores = state_stores(state)
    if not stores:
        return
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.server import arena_path

    for _node, store_dir in stores.values():
        arena_path(StoreConfig(run_dir=store_dir)).unlink(missing_ok=True)
