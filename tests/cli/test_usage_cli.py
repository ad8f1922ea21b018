"""`kvrelay usage` on a real Valkey: the hour hashes of every shard summed over a time range,
grouped, as a table, JSON and CSV."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

import pytest

from kvrelay.cli.errors import CommandError
from kvrelay.cli.main import main
from kvrelay.cli.usage import parse_time, time_range
from kvrelay.core.keys import Keys
from kvrelay.core.usage import account

PREFIX = "use:"
KEYS = Keys(PREFIX, shards=2)
T10 = int(datetime(2026, 1, 1, 10, tzinfo=UTC).timestamp())  # 10:00 UTC
ALICE, BOB = account("alice", "acme", "smol"), account("bob", "acme", "tiny")
ANON = account("", "", "smol")


def cli(capsys, valkey_session, *argv: str) -> tuple[int, str, str]:
    code = main(["usage", *argv, "--redis-url", valkey_session.url, "--key-prefix", PREFIX])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def seeded(r):
    r.set(KEYS.shard_count, 2)  # the CLI reads the shard count the stack wrote
    shard0, shard1 = KEYS.all()
    r.hset(shard0.usage(T10), mapping={f"requests {ALICE}": 2, f"prompt_tokens {ALICE}": 30,
                                       f"cached_tokens {ALICE}": 16,
                                       f"completion_tokens {ALICE}": 12})  # fmt: skip
    r.hset(shard1.usage(T10 + 3600), mapping={f"requests {ALICE}": 1,
                                              f"prompt_tokens {ALICE}": 5,
                                              f"completion_tokens {ALICE}": 3,
                                              f"requests {BOB}": 4, f"prompt_tokens {BOB}": 8,
                                              f"completion_tokens {BOB}": 20,
                                              f"failed_requests {BOB}": 1})  # fmt: skip
    r.hset(shard1.usage(T10), mapping={f"requests {ANON}": 1, f"prompt_tokens {ANON}": 7,
                                       f"completion_tokens {ANON}": 1})  # fmt: skip
    r.hset(shard0.usage(T10 - 3600), f"requests {ALICE}", 100)  # before the range
    r.hset(shard0.usage(T10 + 7200), f"requests {ALICE}", 100)  # after it
    return r


RANGE = ("--since", "2026-01-01T10:00", "--until", "2026-01-01T12:00")


def test_table_sums_every_shard_per_account(capsys, valkey_session, seeded):
    code, out, err = cli(capsys, valkey_session, *RANGE)
    assert (code, err) == (0, "")
    assert out == (
        "usage from 2026-01-01T10:00:00+00:00 to 2026-01-01T12:00:00+00:00 (UTC), 2 shard(s)\n"
        "KEY    TENANT  MODEL  REQUESTS  PROMPT  CACHED  COMPLETION  FAILED\n"
        "-      -       smol          1       7       0           1       0\n"
        "alice  acme    smol          3      35      16          15       0\n"
        "bob    acme    tiny          4       8       0          20       1\n"
        "TOTAL                        8      50      16          36       1\n"
    )


def test_json_grouped_by_tenant(capsys, valkey_session, seeded):
    code, out, _ = cli(capsys, valkey_session, *RANGE, "--by", "tenant", "--json")
    assert code == 0
    zero = {"failed_prompt_tokens": 0, "failed_cached_tokens": 0, "failed_completion_tokens": 0}
    assert json.loads(out) == {
        "since": "2026-01-01T10:00:00+00:00",
        "until": "2026-01-01T12:00:00+00:00",
        "by": ["tenant"],
        "rows": [
            {"tenant": "", "requests": 1, "prompt_tokens": 7, "cached_tokens": 0,
             "completion_tokens": 1, "failed_requests": 0, **zero},
            {"tenant": "acme", "requests": 7, "prompt_tokens": 43, "cached_tokens": 16,
             "completion_tokens": 35, "failed_requests": 1, **zero},
        ],
        "total": {"requests": 8, "prompt_tokens": 50, "cached_tokens": 16,
                  "completion_tokens": 36, "failed_requests": 1, **zero},
    }  # fmt: skip


def test_csv_by_key_and_model_for_one_hour(capsys, valkey_session, seeded):
    code, out, _ = cli(capsys, valkey_session, "--since", str(T10 + 3600), "--until",
                       str(T10 + 7200), "--by", "model", "--by", "key", "--csv")  # fmt: skip
    assert code == 0
    assert out.splitlines() == [
        "model,key,requests,prompt_tokens,cached_tokens,completion_tokens,failed_requests,"
        "failed_prompt_tokens,failed_cached_tokens,failed_completion_tokens",
        "smol,alice,1,5,0,3,0,0,0,0",
        "tiny,bob,4,8,0,20,1,0,0,0",
    ]


def test_time_range_flags():
    now = T10 + 1800.5  # 10:30:00.5

    def ns(**kw) -> argparse.Namespace:
        return argparse.Namespace(**{"since": None, "until": None, "period": None, **kw})

    assert time_range(ns(), now) == (T10 - 10 * 3600, now + 1)  # the current UTC day
    assert time_range(ns(period="hour"), now) == (T10, now + 1)
    assert time_range(ns(since="2h"), now) == (now - 7200, now + 1)
    assert time_range(ns(since="90m", until="30m"), now) == (now - 5400, now - 1800)
    assert parse_time("2026-01-01T10:00:00+01:00", now, "--since") == T10 - 3600
    assert parse_time(str(T10), now, "--since") == T10
    with pytest.raises(CommandError, match="--since 'soon': give unix seconds"):
        parse_time("soon", now, "--since")
    with pytest.raises(CommandError, match="--until must be after --since"):
        time_range(ns(since="1h", until="2h"), now)
