"""Sessions through `kvrelay up`: a conversation naming itself (`prompt_cache_key`) keeps its
pages through a flood of other requests that evicts a conversation that does not, and through
a full `kvrelay down` / `up`; `prompt_cache_retention` is bounded; `kvrelay kv stats` counts
the session."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.e2e.stack import MODEL, Stack
from tests.netlink import wait_until

PAGE = 16  # tokens per page
# SmolLM2-135M's page: 30 layers x K and V x 16 tokens x 3 heads x 64 x 2 bytes (bf16 KV, what
# `up` picks on every x86 host with the C++ kernels) + the 256-byte header, 4 KiB-aligned slots
SLOT = 372736
FLOOD = 24  # distinct ~200-token prompts: ~13 pages each, several times every tier's size


def ask(client, messages, key: str | None = None, **extra):
    body = {"prompt_cache_key": key} if key else {}
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body={**body, **extra}
    )


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def kv_stats(run_dir) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "kv", "stats", "--json", "--run-dir",
         str(run_dir)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def follow_up(messages, resp, text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": text}]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # a worker pool of 64 pages, an arena of 24 and a disk tier of 24: the flood evicts all three
    s = Stack(tmp_path_factory.mktemp("run"), prefill=0, decode=1,
              extra=["--kv-cache-bytes", str(64 * 368640), "--arena-bytes", str(24 * SLOT + 4096),
                     "--disk-bytes", str(24 * (368640 + 256))])  # fmt: skip
    s.up()
    yield s
    s.down()


def test_a_named_session_keeps_its_pages_through_a_flood_and_a_restart(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kept = [{"role": "user", "content": "Describe a lighthouse on a rocky coast."}]
    plain = [{"role": "user", "content": "Describe a windmill in a flat green field."}]
    first = ask(client, kept, key="conversation-1")
    control = ask(client, plain)
    saved = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // PAGE

    def retained() -> int:  # the worker sends its retain one-way as the request ends
        pages = kv_stats(stack.run_dir)["pages"]
        return pages["retained_host"] + pages["retained_disk"] if pages["sessions"] else 0

    wait_until(f"{saved} pages retained", lambda: retained() == saved, 10, stack.logs)

    filler = " ".join(f"item {i} is a plain token of text" for i in range(24))
    for i in range(FLOOD):
        ask(client, [{"role": "user", "content": f"Request {i}: summarize {filler}."}])

    again = ask(client, follow_up(kept, first, "And at night?"), key="conversation-1")
    assert cached(again) >= saved * PAGE, again.usage  # the whole first turn hit
    # the same turn computed cold (a salt of its own matches no page): the same tokens
    cold = ask(client, follow_up(kept, first, "And at night?"), cache_salt="cold")
    assert cached(cold) == 0
    assert cold.choices[0].message.content == again.choices[0].message.content
    lost = ask(client, follow_up(plain, control, "And at night?"))
    # evicted from the pool, the arena and the disk, but for the chat template's first page
    # (the default system prompt), which every request of the flood shares
    assert cached(lost) == PAGE, lost.usage

    stack.down()
    stack.up()
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    after = follow_up(follow_up(kept, first, "And at night?"), again, "And in winter?")
    third = ask(client, after, key="conversation-1")
    assert cached(third) >= (again.usage.prompt_tokens - 1) // PAGE * PAGE, third.usage
    assert kv_stats(stack.run_dir)["pages"]["sessions"] == 1


def test_prompt_cache_retention_is_bounded(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Hi"}]
    for value in ("24h", "in_memory", 30):
        assert ask(client, messages, key="k", prompt_cache_retention=value).usage is not None
    with pytest.raises(openai.BadRequestError) as bad:
        ask(client, messages, key="k", prompt_cache_retention=86401)
    assert bad.value.body["param"] == "prompt_cache_retention"
    assert "86400 seconds at most" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        ask(client, messages, prompt_cache_retention="forever")
    assert bad.value.body["param"] == "prompt_cache_retention"
