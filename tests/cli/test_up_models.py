"""`kvrelay up --model A --model B`: per model its workers, store node and pipeline; the
cores divided between all workers; one model exactly as before."""

from __future__ import annotations

import json

import pytest

from kvrelay.cli.main import build_parser
from kvrelay.cli.up.command import build_programs, resolve_models
from kvrelay.cli.up.models import state_stores
from kvrelay.cli.up.topology import choose
from kvrelay.core.modelref import DEFAULT_MODEL
from tests.cli.test_launch import _main


def model_dir(root, name: str):
    """A directory `resolve_model` takes for a model (config.json and a weights file)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def programs_of(tmp_path, *argv: str):
    args = build_parser().parse_args(["up", "--threads", "4", "--redis-port", "7100", *argv])
    return build_programs(args, tmp_path / "run")


def test_two_models_get_their_own_workers_store_and_pipeline(tmp_path):
    tiny = model_dir(tmp_path, "Tiny_Llama")
    programs, state = programs_of(tmp_path, "--model", DEFAULT_MODEL, "--model", str(tiny))
    by_name = {p.name: p for p in programs}
    assert list(by_name) == [
        "valkey", "store", "store-tiny_llama", "ingress", "decode-0", "decode-tiny_llama-0",
    ]  # fmt: skip
    run = tmp_path / "run"
    first, second = by_name["decode-0"].env, by_name["decode-tiny_llama-0"].env
    # the first model keeps a single-model stack's names; the second is on its own pipeline
    assert first["KVRELAY_WORKER_PIPELINE"] == ""
    assert (first["KVRELAY_WORKER_MODEL"], first["KVRELAY_STORE_RUN_DIR"]) == (
        DEFAULT_MODEL,
        str(run / "store"),
    )
    assert (second["KVRELAY_WORKER_PIPELINE"], second["KVRELAY_WORKER_MODEL"]) == (
        "tiny_llama",
        str(tiny),
    )
    assert second["KVRELAY_STORE_RUN_DIR"] == str(run / "store-tiny_llama")
    store_b = by_name["store-tiny_llama"].env
    assert (store_b["KVRELAY_STORE_MODEL"], store_b["KVRELAY_STORE_NODE_ID"]) == (
        str(tiny),
        "node0-tiny_llama",
    )
    # the store budget is divided between the models' nodes
    assert store_b["KVRELAY_STORE_ARENA_BYTES"] == str((1 << 30) // 2)
    assert by_name["store"].env["KVRELAY_STORE_ARENA_BYTES"] == str((1 << 30) // 2)
    assert by_name["ingress"].env["KVRELAY_INGRESS_MODELS"] == f"{DEFAULT_MODEL},{tiny}"
    # 4 cores, 2 models: one decode worker each (auto), two threads each
    assert [p.command[-1] for p in programs if p.name.startswith("decode-")] == ["2", "2"]
    assert first["OMP_NUM_THREADS"] == second["OMP_NUM_THREADS"] == "2"
    assert (state["decode"], state["prefill"], state["threads_per_worker"]) == (2, 0, 2)
    assert [(m["served"], m["pipeline"], m["decode"]) for m in state["models"]] == [
        (DEFAULT_MODEL, "", ["decode-0"]),
        ("Tiny_Llama", "tiny_llama", ["decode-tiny_llama-0"]),
    ]
    assert state_stores(state) == {
        "store": ("node0", str(run / "store")),
        "store-tiny_llama": ("node0-tiny_llama", str(run / "store-tiny_llama")),
    }
    assert state["topology"]["summary"].startswith("2 models x (1 decode worker), 2 threads each")


def test_one_model_keeps_the_programs_and_state_of_before(tmp_path):
    programs, state = programs_of(tmp_path)
    assert [p.name for p in programs] == ["valkey", "store", "ingress", "decode-0"]
    assert "models" not in state and state["model"] == DEFAULT_MODEL
    env = programs[-1].env
    assert "KVRELAY_WORKER_PIPELINE" not in env and env["OMP_NUM_THREADS"] == "4"
    assert env["KVRELAY_STORE_RUN_DIR"] == str(tmp_path / "run" / "store")
    assert state_stores(state) == {"store": ("node0", str(tmp_path / "run" / "store"))}


def test_counts_are_per_model_and_cores_split_over_every_worker(tmp_path):
    tiny = model_dir(tmp_path, "tiny")
    argv = ["--model", DEFAULT_MODEL, "--model", str(tiny), "--prefill", "1", "--decode", "1"]
    programs, state = programs_of(tmp_path, *argv)
    workers = [p.name for p in programs if p.name.startswith(("prefill-", "decode-"))]
    assert workers == ["prefill-0", "decode-0", "prefill-tiny-0", "decode-tiny-0"]
    assert {p.env["OMP_NUM_THREADS"] for p in programs if p.name in workers} == {"1"}
    assert (state["prefill"], state["decode"]) == (2, 2)
    t = choose(32, 0, None, None, models=2)  # 16 cores per model: one decode worker each
    assert (t.prefill, t.decode, t.threads, t.models) == (0, 1, 16, 2)
    assert choose(2, 0, None, None, models=2).threads == 1
    g = choose(8, 4, None, None, models=2)  # 2 GPUs per model: a prefill and a decode GPU
    assert (g.prefill, g.decode) == (1, 1)


def test_models_come_from_the_config_file_when_not_given(tmp_path):
    tiny = model_dir(tmp_path, "tiny")
    config = tmp_path / "kvrelay.toml"
    config.write_text(f'[ingress]\nmodels = ["{DEFAULT_MODEL}", "{tiny}"]\n')
    args = build_parser().parse_args(["up", "--config", str(config)])
    assert resolve_models(args) == [DEFAULT_MODEL, str(tiny)]
    programs, state = programs_of(tmp_path, "--config", str(config))
    assert [p.name for p in programs][-1] == "decode-tiny-0"
    # every program reads the file too, as `kvrelay serve|worker|store --config`
    assert all(p.command[-2:] == ["--config", str(config)] for p in programs[1:])
    assert state["config"] == str(config)
    flag = build_parser().parse_args(["up", "--config", str(config), "--model", "x"])
    assert resolve_models(flag) == ["x"]  # --model wins over the file


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", DEFAULT_MODEL, "--model", DEFAULT_MODEL],
            f"model '{DEFAULT_MODEL}' is given twice (it is served as '{DEFAULT_MODEL}')",
        ),
        (["--config", "/nonexistent/kvrelay.toml"], "--config: no such file"),
        (
            ["--model", DEFAULT_MODEL, "--model", "other", "--draft-model", DEFAULT_MODEL],
            "a draft model (--draft-model, speculation draft) needs one model per stack",
        ),
    ],
)
def test_bad_model_lists_are_refused_before_launching(tmp_path, capsys, argv, message):
    code, line = _main(capsys, "up", "--run-dir", str(tmp_path / "run"), *argv)
    assert code == 2 and line.startswith(f"kvrelay up: error: {message}")


TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_served_names_and_chat_template_of_one_model(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    programs, state = programs_of(
        tmp_path, "--served-model-name", "smol", "smol-2", "--chat-template", str(template)
    )
    by_name = {p.name: p for p in programs}
    worker = by_name["decode-0"].env
    assert worker["KVRELAY_WORKER_SERVED_MODEL_NAME"] == "smol,smol-2"
    # a copy in the run dir: a restarted worker publishes the template `up` checked
    copy = tmp_path / "run" / "chat-template.jinja"
    assert worker["KVRELAY_WORKER_CHAT_TEMPLATE"] == str(copy)
    assert copy.read_text() == TEMPLATE
    assert by_name["ingress"].env["KVRELAY_INGRESS_MODELS"] == "smol"  # the first name
    assert state["served_model_name"] == ["smol", "smol-2"] and "models" not in state
    # the template text itself works as well (vLLM takes both)
    programs, _ = programs_of(tmp_path, "--chat-template", TEMPLATE)
    assert (tmp_path / "run" / "chat-template.jinja").read_text() == TEMPLATE


def test_served_names_and_chat_templates_per_model(tmp_path):
    tiny = model_dir(tmp_path, "tiny")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    programs, state = programs_of(
        tmp_path, "--model", DEFAULT_MODEL, "--model", str(tiny),
        "--served-model-name", "tiny=t1,t2", "--served-model-name", f"{DEFAULT_MODEL}=smol",
        "--chat-template", f"{tiny}={template}",
    )  # fmt: skip
    by_name = {p.name: p for p in programs}
    # the second model's pipeline and programs are named after its first served name
    assert [p.name for p in programs][-1] == "decode-t1-0"
    first, second = by_name["decode-0"].env, by_name["decode-t1-0"].env
    assert first["KVRELAY_WORKER_SERVED_MODEL_NAME"] == "smol"
    assert "KVRELAY_WORKER_CHAT_TEMPLATE" not in first
    assert (second["KVRELAY_WORKER_SERVED_MODEL_NAME"], second["KVRELAY_WORKER_PIPELINE"]) == (
        "t1,t2",
        "t1",
    )
    assert second["KVRELAY_WORKER_CHAT_TEMPLATE"] == str(tmp_path / "run/chat-template-t1.jinja")
    assert by_name["ingress"].env["KVRELAY_INGRESS_MODELS"] == "smol,t1"
    assert [(m["served"], m["names"]) for m in state["models"]] == [
        ("smol", ["smol"]),
        ("t1", ["t1", "t2"]),
    ]


def test_the_config_file_gives_them_per_model(tmp_path):
    tiny = model_dir(tmp_path, "tiny")
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    config = tmp_path / "kvrelay.toml"
    config.write_text(
        f'[ingress]\nmodels = ["{DEFAULT_MODEL}", "{tiny}"]\n\n'
        '[model.tiny]\nchat_template = "chat.jinja"\nserved_model_name = ["t1", "t2"]\n\n'
        f'[model."{DEFAULT_MODEL}"]\nserved_model_name = "smol"\n'
    )
    programs, _ = programs_of(tmp_path, "--config", str(config))
    by_name = {p.name: p for p in programs}
    assert by_name["ingress"].env["KVRELAY_INGRESS_MODELS"] == "smol,t1"
    # a relative template is the config file's neighbour
    assert (tmp_path / "run/chat-template-t1.jinja").read_text() == TEMPLATE
    # a flag wins over the file
    programs, _ = programs_of(tmp_path, "--config", str(config), "--served-model-name", "tiny=t3")
    assert {p.name: p for p in programs}["ingress"].env["KVRELAY_INGRESS_MODELS"] == "smol,t3"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", DEFAULT_MODEL, "--model", "MODEL2", "--chat-template", "t.jinja"],
            "--chat-template 't.jinja': 2 models are served, say which one (--chat-template "
            f"MODEL=..., MODEL one of {DEFAULT_MODEL}, MODEL2)",
        ),
        (
            ["--model", DEFAULT_MODEL, "--model", "MODEL2", "--served-model-name", "a"],
            "--served-model-name 'a': 2 models are served, say which one",
        ),
        (
            ["--model", DEFAULT_MODEL, "--model", "MODEL2", "--served-model-name", "MODEL2=x",
             "--served-model-name", f"{DEFAULT_MODEL}=y,x"],
            f"served model name 'x' is given to two models ('{DEFAULT_MODEL}' and 'MODEL2')",
        ),
        (
            ["--model", DEFAULT_MODEL, "--model", "MODEL2", "--served-model-name",
             f"MODEL2={DEFAULT_MODEL}"],
            f"served model name '{DEFAULT_MODEL}' is given to two models",
        ),
        (["--chat-template", "/nonexistent/chat.jinja"],
         "--chat-template: chat template '/nonexistent/chat.jinja': no such file"),
        (["--chat-template", "BAD.jinja"],
         "--chat-template: chat template 'BAD.jinja' does not compile: line 1: "),
    ],
)  # fmt: skip
def test_bad_served_names_and_templates_are_refused_before_launching(
    tmp_path, capsys, monkeypatch, argv, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD.jinja").write_text("{% for m in messages %}{{ m.content }")
    code, line = _main(capsys, "up", "--run-dir", str(tmp_path / "run"), *argv)
    assert code == 2 and line.startswith(f"kvrelay up: error: {message}"), line


def test_a_worker_refuses_a_bad_template_or_served_name_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages")
    code, line = _main(capsys, "worker", "decode", "--chat-template", str(bad))
    assert code == 2
    assert line.startswith(f"kvrelay worker: error: chat template '{bad}' does not compile: ")
    code, line = _main(capsys, "generate", "hi", "--chat", "--chat-template", str(bad))
    assert code == 2
    assert line.startswith(f"kvrelay generate: error: --chat-template: chat template '{bad}' ")
    code, line = _main(capsys, "worker", "decode", "--served-model-name", "a,a")
    assert (code, line) == (
        2,
        "kvrelay worker: error: served_model_name must be distinct names separated by commas "
        "(no spaces or braces), got 'a,a'",
    )
