"""Settings are read one way: flag > KVRELAY_<SECTION>_* > deprecated spelling > shared KVRELAY_*
> --config file > default, for every component."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.cli.generate import EXIT_BAD_INPUT
from kvrelay.core import config as settings
from kvrelay.core.config import ConfigError, from_env, read_config_file, redacted
from kvrelay.kvstore.config import StoreConfig
from kvrelay.pipeline.server.config import load_config
from kvrelay.workers.config import (
    DEPRECATED_SECTIONS,
    SECTION,
    engine_env_names,
    load_worker_config,
)
from kvrelay.workers.engine.config import EngineConfig


def test_store_honours_the_shared_redis_url_and_key_prefix():
    env = {"KVRELAY_REDIS_URL": "redis://shared:1/0", "KVRELAY_KEY_PREFIX": "p:"}
    cfg = from_env(StoreConfig, "store", environ=env)
    assert (cfg.redis_url, cfg.key_prefix) == ("redis://shared:1/0", "p:")
    env["KVRELAY_STORE_REDIS_URL"] = "redis://own:2/0"  # the component's own name wins
    assert from_env(StoreConfig, "store", environ=env).redis_url == "redis://own:2/0"


def test_shared_variables_mean_the_same_to_every_component():
    env = {"KVRELAY_REDIS_URL": "redis://h:3/1", "KVRELAY_KEY_PREFIX": "k:"}
    ingress = load_config(environ=env)
    worker = load_worker_config(environ=env)
    store = from_env(StoreConfig, "store", environ=env)
    assert {(c.redis_url, c.key_prefix) for c in (ingress, worker, store)} == {
        ("redis://h:3/1", "k:")
    }


def test_engine_settings_have_one_spelling_for_worker_and_generate():
    env = {"KVRELAY_WORKER_MAX_NUM_SEQS": "9", "KVRELAY_WORKER_THREADS": "3"}
    worker = load_worker_config(environ=env)
    engine = from_env(EngineConfig, SECTION, environ=env, deprecated=DEPRECATED_SECTIONS,
                      env_names=engine_env_names())  # fmt: skip
    assert (worker.engine.max_num_seqs, worker.engine.num_threads) == (9, 3)
    assert (engine.max_num_seqs, engine.num_threads) == (9, 3)


def test_old_engine_spelling_works_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"KVRELAY_ENGINE_KV_CACHE_BYTES": "4096"}
    with caplog.at_level(logging.WARNING, logger="kvrelay.core.config"):
        for _ in range(3):
            engine = from_env(EngineConfig, SECTION, environ=env, deprecated=DEPRECATED_SECTIONS)
            assert engine.kv_cache_bytes == 4096
        assert load_worker_config(environ=env).engine.kv_cache_bytes == 4096
    assert caplog.messages == [
        "KVRELAY_ENGINE_KV_CACHE_BYTES is deprecated: use KVRELAY_WORKER_KV_CACHE_BYTES "
        "(same meaning)"
    ]
    env["KVRELAY_WORKER_KV_CACHE_BYTES"] = "8192"  # the current spelling wins
    assert load_worker_config(environ=env).engine.kv_cache_bytes == 8192


def test_precedence_flag_env_file_default(tmp_path: Path):
    path = tmp_path / "kvrelay.toml"
    path.write_text('key_prefix = "file:"\n[worker]\nlease_ms = 700\nmax_num_seqs = 5\n'
                    '[ingress]\nmax_waiting = 11\n')  # fmt: skip
    env = {"KVRELAY_WORKER_MAX_NUM_SEQS": "6"}
    cfg = load_worker_config(environ=env, config_file=str(path), lease_ms=800)
    assert (cfg.lease_ms, cfg.engine.max_num_seqs, cfg.key_prefix, cfg.block_ms) == (
        800, 6, "file:", 500)  # fmt: skip
    ingress = load_config(environ={}, config_file=str(path))
    assert (ingress.max_waiting, ingress.key_prefix) == (11, "file:")


def test_bad_config_files_name_the_problem(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker\n")
    with pytest.raises(ConfigError, match=r"--config: .*bad.toml is not valid TOML"):
        read_config_file(str(bad), "worker")
    with pytest.raises(ConfigError, match=r"--config: cannot read .*none.toml"):
        read_config_file(str(tmp_path / "none.toml"), "worker")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[store]\narena = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'arena' in the config file"):
        from_env(
            StoreConfig, "store", environ={}, file_values=read_config_file(str(unknown), "store")
        )


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="invalid value 'x' for KVRELAY_WORKER_LEASE_MS"):
        load_worker_config(environ={"KVRELAY_WORKER_LEASE_MS": "x"})


def test_redacted_hides_secrets():
    cfg = StoreConfig(redis_url="redis://u:pw@h:1/0", secret="s3")
    shown = redacted(cfg)
    assert (shown["redis_url"], shown["secret"], shown["arena_bytes"]) == (
        "redis://u:***@h:1/0", "***", 1 << 30)  # fmt: skip


def test_config_show_prints_effective_settings(tmp_path: Path):
    path = tmp_path / "k.toml"
    path.write_text('[store]\narena_bytes = 4096\nsecret = "s"\n')
    env = {"PATH": "/usr/bin:/bin", "KVRELAY_REDIS_URL": "redis://a:pw@h:1/0"}
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "config", "show", "--component", "store",
         "--config", str(path)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    store = json.loads(done.stdout)["store"]
    assert (store["arena_bytes"], store["secret"], store["redis_url"]) == (
        4096, "***", "redis://a:***@h:1/0")  # fmt: skip
    env["KVRELAY_STORE_ARENA_BYTES"] = "lots"
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "config", "show", "--component", "store"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (EXIT_BAD_INPUT, "")
    assert (
        done.stderr == "kvrelay config: error: invalid value 'lots' for KVRELAY_STORE_ARENA_BYTES\n"
    )


def test_flags_are_generated_from_the_settings_fields():
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.serve import SERVE_FLAGS
    from kvrelay.cli.worker import worker_flags

    assert [(f, dest, kind) for f, dest, kind, _ in SERVE_FLAGS[:20]] == [
        ("--redis-url", "redis_url", str), ("--key-prefix", "key_prefix", str),
        ("--shards", "shards", int), ("--host", "host", str), ("--port", "port", int),
        ("--max-body-bytes", "max_body_bytes", int), ("--body-timeout", "body_timeout_s", float),
        ("--max-prompt-tokens", "max_prompt_tokens", int),
        ("--max-tokens-limit", "max_tokens_limit", int),
        ("--route-threshold", "route_threshold", int), ("--max-waiting", "max_waiting", int),
        ("--max-inflight", "max_inflight", int), ("--max-choices", "max_choices", int),
        ("--retry-after", "retry_after_s", int),
        ("--request-timeout", "request_timeout_s", float),
        ("--disconnect-grace", "disconnect_grace_s", float),
        ("--override-generation-config", "override_generation_config", str),
        ("--tool-call-parser", "tool_call_parser", str),
        ("--cache-retention-s", "cache_retention_s", float),
        ("--max-cache-retention-s", "max_cache_retention_s", float),
    ]  # fmt: skip
    assert SERVE_FLAGS[20][:2] == ("--prefetch-hints", "prefetch_hints")  # a bool's parser
    assert [(f, dest, kind) for f, dest, kind, _ in SERVE_FLAGS[22:]] == [
        ("--scheduling-policy", "scheduling_policy", str),
        ("--priority-age-s", "priority_age_s", float),
        ("--api-keys-file", "api_keys_file", str),
    ]  # fmt: skip
    assert SERVE_FLAGS[21][:2] == ("--allow-runtime-lora-updating", "allow_runtime_lora_updating")
    assert SERVE_FLAGS[11][3] == (
        "429 beyond this many open requests (default 4096; KVRELAY_INGRESS_MAX_INFLIGHT)"
    )
    assert [f for f, *_ in worker_flags()] == [
        "--name", "--model", "--redis-url", "--key-prefix", "--shards", "--serve-shards",
        "--threads", "--device", "--dtype",
        "--quantization", "--kv-cache-dtype", "--attention-precision", "--speculation",
        "--num-speculative-tokens",
        "--prompt-lookup-min", "--prompt-lookup-max", "--draft-model", "--kv-cache-bytes",
        "--lora-modules", "--max-loras", "--max-lora-rank", "--max-num-seqs",
        "--max-num-batched-tokens",
        "--store-run-dir", "--lease-ms", "--redis-socket-timeout-s", "--redis-keepalive-s",
        "--stream-interval-ms", "--metrics-port", "--slot-dir",
        "--override-generation-config", "--chat-template", "--served-model-name",
    ]  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(["store", "--keep-arena", "off", "--arena-bytes", "4096"])
    assert (args.keep_arena, args.arena_bytes, args.node_id) == (False, 4096, None)
    args = parser.parse_args(["generate", "hi", "--num-threads", "2"])
    assert (args.num_threads, args.max_num_seqs) == (2, None)


def test_speculation_settings_from_flags_env_and_file(tmp_path: Path):
    from kvrelay.cli.main import build_parser

    default = load_worker_config(environ={}).engine
    assert (default.speculation, default.num_speculative_tokens, default.prompt_lookup_min,
            default.prompt_lookup_max, default.draft_model) == ("auto", 6, 2, 4, None)  # fmt: skip
    env = {
        "KVRELAY_WORKER_SPECULATION": "ngram",
        "KVRELAY_WORKER_NUM_SPECULATIVE_TOKENS": "3",
        "KVRELAY_WORKER_PROMPT_LOOKUP_MIN": "1",
        "KVRELAY_WORKER_PROMPT_LOOKUP_MAX": "5",
        "KVRELAY_WORKER_DRAFT_MODEL": "",  # empty: none
    }
    cfg = load_worker_config(environ=env).engine
    assert (cfg.speculation, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
            cfg.prompt_lookup_max, cfg.draft_model) == ("ngram", 3, 1, 5, None)  # fmt: skip
    engine = from_env(EngineConfig, SECTION, environ=env, env_names=engine_env_names())
    assert (engine.speculation, engine.num_speculative_tokens, engine.prompt_lookup_min,
            engine.prompt_lookup_max, engine.draft_model) == ("ngram", 3, 1, 5, None)  # fmt: skip
    path = tmp_path / "k.toml"
    path.write_text('[worker]\nspeculation = "draft"\ndraft_model = "smollm2-135m"\n')
    cfg = load_worker_config(environ={}, config_file=str(path), num_speculative_tokens=2).engine
    assert (cfg.speculation, cfg.draft_model, cfg.num_speculative_tokens) == (
        "draft", "smollm2-135m", 2)  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(["worker", "decode", "--speculation", "off",
                              "--num-speculative-tokens", "4", "--prompt-lookup-min", "3",
                              "--prompt-lookup-max", "3", "--draft-model", "d"])  # fmt: skip
    assert (args.speculation, args.num_speculative_tokens, args.prompt_lookup_min,
            args.prompt_lookup_max, args.draft_model) == ("off", 4, 3, 3, "d")  # fmt: skip
    args = parser.parse_args(["generate", "hi", "--speculation", "ngram",
                              "--num-speculative-tokens", "2", "--prompt-lookup-max", "6",
                              "--draft-model", "d"])  # fmt: skip
    assert (args.speculation, args.num_speculative_tokens, args.prompt_lookup_min,
            args.prompt_lookup_max, args.draft_model) == ("ngram", 2, None, 6, "d")  # fmt: skip
    args = parser.parse_args(["up", "--speculation", "draft", "--num-speculative-tokens", "5",
                              "--draft-model", "d"])  # fmt: skip
    assert (args.speculation, args.num_speculative_tokens, args.draft_model) == ("draft", 5, "d")
    assert parser.parse_args(["up"]).speculation is None  # not given: the workers' own


SPECULATION_ERRORS = [
    ({"KVRELAY_WORKER_SPECULATION": "eagle"},
     "speculation must be one of auto, off, ngram, draft, got 'eagle'"),
    ({"KVRELAY_WORKER_SPECULATION": "draft"},
     "speculation 'draft' needs a draft model (--draft-model)"),
    ({"KVRELAY_WORKER_NUM_SPECULATIVE_TOKENS": "0"},
     "num_speculative_tokens must be at least 1, got 0"),
    ({"KVRELAY_WORKER_PROMPT_LOOKUP_MIN": "0"}, "prompt_lookup_min must be at least 1, got 0"),
    ({"KVRELAY_WORKER_PROMPT_LOOKUP_MIN": "5"},
     "prompt_lookup_min (5) must not exceed prompt_lookup_max (4)"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "message"), SPECULATION_ERRORS)
def test_bad_speculation_settings_are_refused(env, message):
    with pytest.raises(ConfigError) as info:
        load_worker_config(environ=env)
    assert str(info.value) == message


def test_bad_speculation_flags_exit_2_in_one_line(capsys):
    from kvrelay.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["worker", "decode", "--speculation", "eagle"])
    assert info.value.code == 2
    assert "argument --speculation: invalid choice: 'eagle'" in capsys.readouterr().err
    # refused by the settings' check, before the worker loads anything
    assert main(["worker", "decode", "--speculation", "draft"]) == 2
    assert capsys.readouterr().err == (
        "kvrelay worker: error: speculation 'draft' needs a draft model (--draft-model)\n"
    )
    argv = ["worker", "decode", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvrelay worker: error: prompt_lookup_min (3) must not exceed prompt_lookup_max (2)\n"
    )


FILE_TYPE_ERRORS = [
    ("redis_url = 5", "invalid value 5 for redis_url in {path}: want a string"),
    ('[ingress]\nport = "8000"', 'invalid value "8000" for port in {path}: want a whole number'),
    ("[ingress]\nport = true", "invalid value true for port in {path}: want a whole number"),
    ("[ingress]\nport = 80.5", "invalid value 80.5 for port in {path}: want a whole number"),
    ('[ingress]\nrequest_timeout_s = "9"',
     'invalid value "9" for request_timeout_s in {path}: want a number'),
    ("[ingress]\nrequest_timeout_s = false",
     "invalid value false for request_timeout_s in {path}: want a number"),
    ('[ingress]\nmodels = "m"', 'invalid value "m" for models in {path}: want a list of strings'),
    ("[ingress]\nmodels = [1]", "invalid value [1] for models in {path}: want a list of strings"),
    ("[ingress]\nkey_prefix = 1.5", "invalid value 1.5 for key_prefix in {path}: want a string"),
    ("[ingress]\noverride_generation_config = 5",
     'invalid value 5 for override_generation_config in {path}: want a string or "none"'),
    ('[worker]\nthreads = "4"',
     'invalid value "4" for threads in {path}: want a whole number or "none"'),
    ("[store]\nkeep_arena = 1", "invalid value 1 for keep_arena in {path}: want true or false"),
]  # fmt: skip
LOADERS = {
    "ingress": lambda path: load_config(environ={}, config_file=path),
    "worker": lambda path: load_worker_config(environ={}, config_file=path),
    "store": lambda path: from_env(
        StoreConfig, "store", environ={}, file_values=read_config_file(path, "store")
    ),
}


@pytest.mark.parametrize(
    ("text", "message"), FILE_TYPE_ERRORS, ids=[t for t, _ in FILE_TYPE_ERRORS]
)
def test_config_file_values_are_type_checked(tmp_path: Path, text, message):
    # before: taken as they were (redis_url = 5 crashed `serve` later with an AttributeError)
    path = tmp_path / "k.toml"
    path.write_text(text + "\n")
    component = text[1:].split("]", 1)[0] if text.startswith("[") else "ingress"
    with pytest.raises(ConfigError) as err:
        LOADERS[component](str(path))
    assert str(err.value) == message.format(path=path)


def test_a_config_file_value_of_the_wrong_type_is_exit_2_in_one_line(tmp_path: Path, capsys):
    from kvrelay.cli.main import main

    path = tmp_path / "k.toml"
    path.write_text("redis_url = 5\n")
    for argv in (("config", "show"), ("serve",), ("worker", "decode")):
        capsys.readouterr()  # before: `config show` printed 5 and exited 0
        assert main([*argv, "--config", str(path)]) == 2
        assert capsys.readouterr() == (
            "",
            f"kvrelay {argv[0]}: error: invalid value 5 for redis_url in {path}: want a string\n",
        )


def test_config_file_values_of_a_compatible_type_are_converted(tmp_path: Path):
    path = tmp_path / "k.toml"
    path.write_text(
        "override_generation_config = {temperature = 0.5}\n"
        "[ingress]\nrequest_timeout_s = 30\nmax_body_bytes = 8e6\nmodels = ['a', 'b']\n"
        '[worker]\nthreads = "none"\nstore_run_dir = ""\n'
        "[worker.override_generation_config]\ntop_p = 0.8\nmax_new_tokens = 64\n"
    )
    ingress = load_config(environ={}, config_file=str(path))
    assert (ingress.request_timeout_s, ingress.max_body_bytes, ingress.models) == (
        30.0, 8_000_000, ("a", "b"))  # fmt: skip
    assert type(ingress.request_timeout_s) is float and type(ingress.max_body_bytes) is int
    # a table for the JSON-text setting is kept as JSON text (top level: every component)
    assert ingress.override_generation_config == '{"temperature": 0.5}'
    assert ingress.generation_override.temperature == 0.5
    worker = load_worker_config(environ={}, config_file=str(path))
    assert (worker.engine.num_threads, worker.store_run_dir) == (None, None)
    assert worker.override_generation_config == '{"top_p": 0.8, "max_new_tokens": 64}'
    assert worker.generation_override.to_dict() == {"top_p": 0.8, "max_tokens": 64}


def test_the_worker_settings_nest_the_engine_settings(tmp_path: Path):
    from kvrelay.core.config import settings_of
    from kvrelay.workers.config import WorkerConfig

    # one definition: no engine field is copied into the worker's own
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert worker_fields & {f.name for f in dataclasses.fields(EngineConfig)} == set()
    # a worker batches more, and runs the attention its host runs fastest
    assert WorkerConfig().engine == EngineConfig(max_num_seqs=64, attention_precision="auto")
    # every engine setting is a worker setting, spelled flat (threads: num_threads)
    names = list(settings_of(WorkerConfig))
    assert names[:6] == ["redis_url", "key_prefix", "shards", "name", "model", "dtype"]
    assert {"threads", "num_blocks", "cuda_graphs"} <= set(names) and "num_threads" not in names
    env = {"KVRELAY_WORKER_NUM_BLOCKS": "12", "KVRELAY_WORKER_CUDA_GRAPHS": "off"}
    path = tmp_path / "k.toml"
    path.write_text("[worker]\nthreads = 2\nmodel = 'm'\n")
    cfg = load_worker_config(environ=env, config_file=str(path), max_model_len=99)
    assert cfg.engine == EngineConfig(
        model="m", num_threads=2, num_blocks=12, cuda_graphs=False, max_num_seqs=64,
        max_model_len=99, attention_precision="auto")  # fmt: skip
    shown = redacted(cfg)
    assert list(shown) == names
    assert (shown["threads"], shown["num_blocks"], shown["model"]) == (2, 12, "m")
    # a whole engine section may be given, the flags over it
    given = load_worker_config(environ={}, engine=EngineConfig(page_size=8), max_num_seqs=3)
    assert given.engine == EngineConfig(page_size=8, max_num_seqs=3)
    with pytest.raises(ConfigError, match="unknown setting 'num_threads' for WorkerConfig"):
        load_worker_config(environ={}, num_threads=2)


def test_the_stream_interval_is_a_worker_setting_of_zero_or_more():
    assert load_worker_config(environ={}).stream_interval_ms == 0
    got = load_worker_config(environ={"KVRELAY_WORKER_STREAM_INTERVAL_MS": "250"})
    assert got.stream_interval_ms == 250
    with pytest.raises(ConfigError) as info:
        load_worker_config(environ={"KVRELAY_WORKER_STREAM_INTERVAL_MS": "-5"})
    assert str(info.value) == "stream_interval_ms must be 0 or more, got -5"
