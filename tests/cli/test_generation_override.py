"""`--override-generation-config` on the commands: a bad value is a one-line usage error of
`serve`, `worker` and `up`; `up` gives the value to the ingress and every worker."""

from __future__ import annotations

import json

from kvrelay.cli.main import build_parser, main
from kvrelay.cli.up.command import build_programs

OVERRIDE = {"temperature": 0.5, "top_k": 40, "max_new_tokens": 32}


def _main(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().err.splitlines()


BAD = "override_generation_config: unknown key 'temp' (known: temperature, top_p, top_k, "
BAD += "min_p, repetition_penalty, max_tokens, max_new_tokens)"


def test_bad_override_is_a_one_line_usage_error(capsys, monkeypatch, tmp_path):
    flag = ["--override-generation-config", '{"temp": 0.2}']
    assert _main(capsys, "serve", *flag) == (2, [f"kvrelay serve: error: {BAD}"])
    assert _main(capsys, "worker", "decode", *flag) == (2, [f"kvrelay worker: error: {BAD}"])
    run = tmp_path / "run"
    assert _main(capsys, "up", "--run-dir", str(run), *flag) == (
        2,
        [f"kvrelay up: error: ingress: {BAD}"],
    )
    assert not run.exists()
    monkeypatch.setenv("KVRELAY_INGRESS_OVERRIDE_GENERATION_CONFIG", "temperature=0.2")
    assert _main(capsys, "serve") == (
        2,
        [
            "kvrelay serve: error: override_generation_config: not valid JSON "
            "(Expecting value: line 1 column 1 (char 0))"
        ],
    )


def test_up_gives_the_override_to_the_ingress_and_the_workers(tmp_path):
    value = json.dumps(OVERRIDE)
    args = build_parser().parse_args(
        ["up", "--prefill", "1", "--decode", "1", "--override-generation-config", value]
    )
    by = {p.name: p.command for p in build_programs(args, tmp_path)[0]}
    flag = ["--override-generation-config", value]
    assert by["ingress"][-2:] == flag
    assert by["prefill-0"][-2:] == flag and by["decode-0"][-2:] == flag
    assert "--override-generation-config" not in by["store"]
