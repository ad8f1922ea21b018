"""Every `KVRELAY_*` variable is read through kvrelay.core.config, and the shared defaults are
stated once (issue 24).

Walks `kvrelay/` with `ast`:

- outside core/config.py no expression reads a `KVRELAY_*` name from a mapping: `.get(NAME)`,
  `.pop(NAME)`, `[NAME]` read, `NAME in ...` (any comparison), `os.getenv(NAME)`, where NAME
  is the string or a module-level constant holding it (`ENV_ISA`); writing one for a child
  process is fine;
- `os.environ`/`os.getenv` appear only in core/config.py and the files listed in
  `ENVIRON_USERS`, each for a variable that is not ours (UCX's, CUDA's, OpenAI's) or to hand
  this process's environment to its children;
- the Redis URL, key prefix, cache dir, store run dir and model defaults are string constants
  in one place only (docstrings aside).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path

from kvrelay.core import config as settings
from kvrelay.core.config import (
    DEFAULT_CACHE_DIR,
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    CacheSettings,
    RedisSettings,
    cache_root,
    setting,
)
from kvrelay.core.keys import Keys
from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.kernels.cpu_build import ENV_FORCE, ENV_ISA, KernelSettings, kernel_settings
from kvrelay.kvstore.client import default_run_dir
from kvrelay.kvstore.config import StoreConfig
from kvrelay.pipeline.client.producer import AsyncClient, Client
from kvrelay.pipeline.server.config import IngressConfig
from kvrelay.workers.config import STORE_RUN_DIR_ENV, WorkerConfig, load_worker_config

PACKAGE = Path(__file__).resolve().parents[2] / "kvrelay"
SETTINGS_FILE = "core/config.py"
# file -> why it may touch os.environ: none of these reads a KVRELAY_* variable
ENVIRON_USERS = {
    "kvstore/transport/ucx_runtime.py": "setdefault of UCX's own variables before ucxx starts",
    "cli/up/command.py": "hands its environment to the children; reads CUDA_VISIBLE_DEVICES",
    "cli/bench.py": "OPENAI_API_KEY, the OpenAI clients' variable",
    "pipeline/server/api_keys.py": "a keys file's key_env: a variable the operator names",
}
STORE_RUN_DIR_DEFAULT = next(
    f.default for f in dataclasses.fields(StoreConfig) if f.name == "run_dir"
)
# value -> the one file that states it (a Prometheus metric prefix also spells "kvrelay:")
DEFAULTS = {
    DEFAULT_REDIS_URL: {SETTINGS_FILE},
    DEFAULT_KEY_PREFIX: {SETTINGS_FILE, "pipeline/metrics.py"},
    DEFAULT_CACHE_DIR: {SETTINGS_FILE},
    STORE_RUN_DIR_DEFAULT: {"kvstore/config.py"},
    DEFAULT_MODEL: {"core/modelref.py"},
}


def modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "..."` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def ours(node: ast.expr, constants: dict[str, str]) -> bool:
    """Whether `node` is a KVRELAY_* variable name (spelled, or a module constant)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        value = node.value
    elif isinstance(node, ast.Name):
        value = constants.get(node.id, "")
    else:
        return False
    return value.startswith(settings.ENV_PREFIX)


def env_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    constants = string_constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ours(node.args[0], constants):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("get", "pop", "getenv"):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if ours(node.slice, constants):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Compare) and ours(node.left, constants):
            yield node.lineno, ast.unparse(node)  # `NAME in env`, `NAME == ...` alike


def environ_uses(tree: ast.Module) -> Iterator[int]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            yield node.lineno


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_no_kvrelay_variable_is_read_beside_the_settings():
    reads = [
        f"{name}:{line}: {text}"
        for name, tree in modules()
        if name != SETTINGS_FILE
        for line, text in env_reads(tree)
    ]
    assert reads == []


def test_os_environ_only_where_a_variable_is_not_ours():
    users = {name for name, tree in modules() if any(environ_uses(tree))}
    assert users == {SETTINGS_FILE, *ENVIRON_USERS}


def test_the_checks_see_reads_by_name_and_by_constant():
    tree = ast.parse(
        'import os\nENV = "KVRELAY_X"\nos.environ.get(ENV)\nos.getenv("KVRELAY_Y")\n'
        'env["KVRELAY_Z"]\n"KVRELAY_W" in os.environ\nenv["KVRELAY_V"] = "1"\n'
    )
    assert [line for line, _ in env_reads(tree)] == [3, 4, 5, 6]
    assert sorted(set(environ_uses(tree))) == [3, 4, 6]


def test_shared_defaults_are_stated_once():
    found: dict[str, set[str]] = {value: set() for value in DEFAULTS}
    for name, tree in modules():
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in found and id(node) not in skip:
                found[node.value].add(name)
    assert found == DEFAULTS


def test_every_component_takes_the_redis_section_defaults():
    for cls in (WorkerConfig, IngressConfig):
        assert issubclass(cls, RedisSettings)
        assert [f.name for f in dataclasses.fields(cls)][:2] == ["redis_url", "key_prefix"]
        assert (cls().redis_url, cls().key_prefix) == (DEFAULT_REDIS_URL, DEFAULT_KEY_PREFIX)
    assert StoreConfig().key_prefix == DEFAULT_KEY_PREFIX == Keys().prefix
    params = inspect.signature(AsyncClient).parameters
    assert (params["redis_url"].default, params["key_prefix"].default) == (
        DEFAULT_REDIS_URL,
        DEFAULT_KEY_PREFIX,
    )
    assert inspect.signature(Client).parameters["redis_url"].default == DEFAULT_REDIS_URL


def test_process_settings_read_their_variables(monkeypatch, tmp_path):
    monkeypatch.delenv("KVRELAY_CACHE_DIR", raising=False)
    assert cache_root() == Path(DEFAULT_CACHE_DIR).expanduser()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", "")  # empty: the default, as before
    assert cache_root() == Path(DEFAULT_CACHE_DIR).expanduser()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert CacheSettings(str(tmp_path)).path == tmp_path
    env = {ENV_FORCE: "Torch", ENV_ISA: "avx2"}
    assert (ENV_FORCE, ENV_ISA) == ("KVRELAY_KERNELS_CPU", "KVRELAY_KERNELS_ISA")
    assert kernel_settings(env) == KernelSettings(cpu="Torch", isa="avx2")
    assert kernel_settings(env).torch_only and not kernel_settings({}).torch_only
    monkeypatch.delenv("KVRELAY_STORE_RUN_DIR", raising=False)
    assert default_run_dir() == STORE_RUN_DIR_DEFAULT
    monkeypatch.setenv("KVRELAY_STORE_RUN_DIR", str(tmp_path))
    assert default_run_dir() == str(tmp_path)


def test_one_setting_is_read_like_from_env_without_the_others():
    env = {"KVRELAY_KEY_PREFIX": "p:", "KVRELAY_REDIS_URL": "not a url"}
    assert setting(RedisSettings, "key_prefix", environ=env) == "p:"  # the bad URL is not read
    assert setting(RedisSettings, "redis_url", environ={}) == DEFAULT_REDIS_URL
    assert setting(StoreConfig, "run_dir", "STORE", {}, default=None) is None
    env = {"KVRELAY_WORKER_KEY_PREFIX": "w:", "KVRELAY_KEY_PREFIX": "p:"}
    assert setting(WorkerConfig, "key_prefix", "WORKER", env) == "w:"
    assert setting(WorkerConfig, "lease_ms", "WORKER", {"KVRELAY_WORKER_LEASE_MS": "7"}) == 7


def test_the_worker_falls_back_to_the_store_run_dir_variable():
    assert STORE_RUN_DIR_ENV == "KVRELAY_STORE_RUN_DIR"
    env = {STORE_RUN_DIR_ENV: "/run/store"}
    assert load_worker_config(environ=env).store_run_dir == "/run/store"
    env["KVRELAY_WORKER_STORE_RUN_DIR"] = "/run/own"  # the worker's own variable wins
    assert load_worker_config(environ=env).store_run_dir == "/run/own"
    assert load_worker_config(environ=env, store_run_dir="/flag").store_run_dir == "/flag"


def test_the_producer_client_takes_the_ingress_request_limits():
    """A batch job's client and the HTTP ingress refuse and route the same requests."""
    ingress = IngressConfig()
    params = inspect.signature(AsyncClient).parameters
    pairs = {
        "route_threshold": "route_threshold",
        "timeout_s": "request_timeout_s",
        "max_prompt_tokens": "max_prompt_tokens",
        "max_tokens_limit": "max_tokens_limit",
        "block_ms": "read_block_ms",
    }
    assert {p: params[p].default for p in pairs} == {
        p: getattr(ingress, f) for p, f in pairs.items()
    }
