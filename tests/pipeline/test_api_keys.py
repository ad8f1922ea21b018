"""The keys file (server/api_keys.py): each key's policy read exactly, every mistake a clear
ConfigError that names the key and the field."""

from __future__ import annotations

import pytest

from kvrelay.core.config import ConfigError
from kvrelay.core.messages import PRIORITY_BOUND
from kvrelay.pipeline.server.api_keys import (
    ANONYMOUS,
    ApiKeys,
    KeyPolicy,
    key_id_of,
    read_keys_file,
)
from kvrelay.pipeline.server.config import IngressConfig

FULL = """
[[key]]
name = "alice"
key = "sk-alice"
tenant = "acme"
weight = 2
priority = 5
priority_range = [0, 10]
rpm = 600
tpm = 100000
max_concurrent = 16

[[key]]
name = "bob"
key_env = "BOB_KEY"
tenant = "acme"
weight = 0.5

[[key]]
name = "carol"
key = "sk-carol"
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_a_full_keys_file(tmp_path):
    alice, bob, carol = read_keys_file(write(tmp_path, FULL), {"BOB_KEY": "sk-bob"})
    assert alice == KeyPolicy(name="alice", key="sk-alice", tenant="acme", weight=2.0,
                              priority=5, min_priority=0, max_priority=10, rpm=600, tpm=100000,
                              max_concurrent=16)  # fmt: skip
    assert bob == KeyPolicy(name="bob", key="sk-bob", tenant="acme", weight=0.5)
    assert (bob.rpm, bob.tpm, bob.max_concurrent, bob.limited) == (0, 0, 0, False)
    assert alice.limited and not carol.limited
    assert (carol.tenant, carol.priority) == ("carol", 0)
    assert (carol.min_priority, carol.max_priority) == (-PRIORITY_BOUND, PRIORITY_BOUND)
    assert "sk-alice" not in repr(alice)  # the key never shows in logs
    assert alice.key_id == key_id_of("sk-alice") and len(alice.key_id) == 16
    assert ANONYMOUS.key_id == "" and not ANONYMOUS.limited


def test_keys_match_and_tenant_weights(tmp_path):
    keys = ApiKeys(("sk-plain",), read_keys_file(write(tmp_path, FULL), {"BOB_KEY": "sk-bob"}))
    assert keys.required
    assert keys.match("sk-bob").name == "bob"
    assert keys.match("sk-bo") is None and keys.match("") is None
    plain = keys.match("sk-plain")
    assert (plain.name, plain.tenant) == (f"key-{key_id_of('sk-plain')[:8]}", key_id_of("sk-plain"))
    assert not plain.limited
    assert keys.tenant_weights == {plain.tenant: 1.0, "acme": 2.0, "carol": 1.0}
    assert keys.weight(keys.match("sk-bob")) == 2.0  # the tenant's: its largest key's
    assert not ApiKeys().required


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('name = "a"\nkey = "k"\nrpms = 5', "keys file: key #1: unknown field(s) rpms"),
        ('key = "k"', "keys file: key #1: name must be a non-empty string"),
        ('name = " "\nkey = "k"', "keys file: key #1: name must be a non-empty string"),
        ('name = "a"', "keys file: key 'a': give exactly one of key and key_env"),
        (
            'name = "a"\nkey = "k"\nkey_env = "K"',
            "keys file: key 'a': give exactly one of key and key_env",
        ),
        (
            'name = "a"\nkey_env = "UNSET_KEY"',
            "keys file: key 'a': environment variable 'UNSET_KEY' is not set",
        ),
        (
            'name = "a"\nkey = " k"',
            "keys file: key 'a': key must be a non-empty string without spaces at its ends",
        ),
        ('name = "a"\nkey = 5', "keys file: key 'a': key must be a non-empty string without"),
        ('name = "a"\nkey = "k"\ntenant = ""', "keys file: key 'a': tenant must be a non-empty"),
        (
            'name = "a"\nkey = "k"\nweight = 0',
            "keys file: key 'a': weight must be > 0 and <= 1e+06",
        ),
        ('name = "a"\nkey = "k"\nweight = true', "keys file: key 'a': weight must be a number"),
        (
            'name = "a"\nkey = "k"\nrpm = -1',
            "keys file: key 'a': rpm must be an integer in [0, 1099511627776], got -1",
        ),
        (
            'name = "a"\nkey = "k"\ntpm = 1.5',
            "keys file: key 'a': tpm must be an integer in [0, 1125899906842624], got 1.5",
        ),
        (
            'name = "a"\nkey = "k"\nmax_concurrent = "4"',
            "keys file: key 'a': max_concurrent must be an integer in [0, 1073741824], got '4'",
        ),
        (
            'name = "a"\nkey = "k"\nrpm = true',
            "keys file: key 'a': rpm must be an integer in [0, 1099511627776], got True",
        ),
        (
            'name = "a"\nkey = "k"\npriority_range = [5, 1]',
            "keys file: key 'a': priority_range must be [low, high] integers, low <= high",
        ),
        (
            'name = "a"\nkey = "k"\npriority_range = [0, 10]\npriority = 11',
            "keys file: key 'a': priority must be an integer in [0, 10], got 11",
        ),
    ],
)
def test_a_bad_key_is_a_clear_config_error(tmp_path, table, message):
    path = write(tmp_path, f"[[key]]\n{table}\n")
    with pytest.raises(ConfigError) as info:
        read_keys_file(path, {})
    assert str(info.value).startswith(message)


def test_a_bad_file_is_a_clear_config_error(tmp_path):
    cases = [
        ("[[keys]]\nname = 'a'\n", "unknown table(s) keys"),
        ("[key]\nname = 'a'\n", "write each key as a [[key]] table"),
        ("[[key]\n", "not TOML: "),
    ]
    for text, message in cases:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            read_keys_file(path, {})
        assert str(info.value).startswith(f"keys file {path}: {message}")
    with pytest.raises(ConfigError, match=r"keys file /nonexistent/keys.toml: No such file"):
        read_keys_file("/nonexistent/keys.toml", {})
    assert read_keys_file(write(tmp_path, ""), {}) == ()


def test_duplicate_keys_and_names(tmp_path):
    twice = '[[key]]\nname = "a"\nkey = "k"\n[[key]]\nname = "b"\nkey = "k"\n'
    with pytest.raises(ConfigError, match="^API key of 'b' is given twice$"):
        ApiKeys.load((), write(tmp_path, twice))
    with pytest.raises(ConfigError, match="^API key of 'a' is given twice$"):
        ApiKeys.load(("k",), write(tmp_path, '[[key]]\nname = "a"\nkey = "k"\n'))
    same_name = '[[key]]\nname = "a"\nkey = "k1"\n[[key]]\nname = "a"\nkey = "k2"\n'
    with pytest.raises(ConfigError, match="^two API keys are named 'a'$"):
        ApiKeys.load((), write(tmp_path, same_name))


def test_the_ingress_refuses_a_bad_keys_file_at_start(tmp_path):
    path = write(tmp_path, '[[key]]\nname = "a"\nkey = "k"\nrpm = -5\n')
    with pytest.raises(ConfigError, match=r"rpm must be an integer in \[0, 1099511627776\]"):
        IngressConfig(api_keys_file=path).validate()
    good = write(tmp_path, '[[key]]\nname = "b"\nkey = "kb"\ntpm = 7\n')
    config = IngressConfig(api_keys_file=good).validate()
    assert config.keys.match("kb").tpm == 7
