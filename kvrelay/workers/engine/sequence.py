"""One request's state inside the engine: tokens, blocks, progress, finish."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.enums import FinishReason
from kvrelay.core.messages import Retention
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.ngram import NgramIndex

# A request's acceptance estimate starts at PRIOR_ACCEPTED / PRIOR_TRIALS and forgets old
# verifications by DECAY per verification (and per step without a draft, so a request whose
# drafts stopped paying is probed again now and then).
PRIOR_ACCEPTED = 1.0
PRIOR_TRIALS = 2.0
DECAY = 0.9


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its prompt-lookup index and acceptance record."""

    ngram: NgramIndex | None = None
    accepted: float = PRIOR_ACCEPTED  # decayed draft tokens accepted
    trials: float = PRIOR_TRIALS  # decayed draft tokens verified (up to the first rejection)
    num_draft_tokens: int = 0  # drafted and verified
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # steps that verified a draft
    draft_computed: int = 0  # draft model: tokens whose K/V its pool holds for this request

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self.accepted / self.trials

    def record(self, drafted: int, accepted: int, rejected: bool) -> None:
        """A verification of `drafted` tokens that accepted the first `accepted`, then
        rejected the next (`rejected`) or stopped (all accepted, or the request ended)."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_verifications += 1
        self.accepted = self.accepted * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + rejected

    def idle(self) -> None:
        """A step without a draft: drift back toward the prior."""
        self.accepted = self.accepted * DECAY + PRIOR_ACCEPTED * (1 - DECAY)
        self.trials = self.trials * DECAY + PRIOR_TRIALS * (1 - DECAY)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity semantics: `seq in running` must not compare lists
class Sequence:
    """Token ids are `prompt + outputs`; K/V of the first `num_computed_tokens` are in blocks."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    cache_salt: str = ""
    retention: Retention | None = None  # the store keeps its pages for this session
    priority: int = 0  # lower first: admitted before, preempted after higher values
    tenant: str = ""  # fair shares of sequence slots between tenants, by weight
    weight: float = 1.0
    handoff_after: int | None = None
    lora: Any = None  # its LoRA adapter (model.lora.LoraAdapter), None: the base model
    num_resumed_tokens: int = 0  # outputs given at add_request (already emitted elsewhere)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # KV group 0's (core.kv_layout)
    # the other KV groups' tables; a local group's entries behind its window are released (-1)
    group_tables: list[list[int]] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the leading full blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from device cache or store (first admit)
    num_device_cached_tokens: int = 0
    num_store_cached_tokens: int = 0
    num_saved_blocks: int = 0  # leading blocks known to be in the store
    num_registered_blocks: int = 0  # leading blocks registered in the device prefix cache
    num_preemptions: int = 0
    admitted: bool = False
    # Store prefix fetch (KVCacheManager.ready): in flight, settled, blocks loaded for it.
    fetch: Any = None
    store_checked: bool = False
    loaded_blocks: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    handoff: bool = False
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Detokenizer/stop-string state lives in the engine's `OutputProcessor` (text tail here).
    output_text: str = ""
    emitted_text_len: int = 0
    detokenizer: Any = None
    grammar: Any = None  # structured output: a GrammarState (engine/grammar.py), else None
    # prompt_logprobs: one entry per prompt token so far (see TokenChunk.prompt_logprobs);
    # None when not asked for, or when the prompt was computed elsewhere (resumed)
    prompt_logprobs: list[dict[str, Any]] | None = None
    spec: SpecState = field(default_factory=SpecState)
    draft: list[int] = field(default_factory=list)  # proposed for the coming step

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is computed: the next step samples one (or verifies a
        draft)."""
        return (
            self.num_computed_tokens == len(self.token_ids) - 1 and not self.wants_prompt_logprobs
        )

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still collecting prompt logprobs: every prompt position must be computed (no
        prefix hits), and its logits kept."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def grammar_ready(self) -> bool:
        """False while its structured-output grammar is still being compiled."""
        return self.grammar is None or self.grammar.ready

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_new_outputs(self) -> int:
        """Outputs produced by this engine (not counting resumed ones)."""
        return self.num_output_tokens - self.num_resumed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def crowded_tenant(held: Iterable[tuple[str, float]]) -> tuple[str, int, float]:
    """Of sequence slots held by (tenant, weight), the tenant holding the most for its weight:
    (that tenant, its slots, slots / weight). The scheduler's fair displacement and a full
    worker's reader (`Inflight.crowding`) judge by it alike."""
    counts: dict[str, int] = {}
    weights: dict[str, float] = {}
    for tenant, weight in held:
        counts[tenant] = counts.get(tenant, 0) + 1
        weights[tenant] = weight
    tenant = max(counts, key=lambda t: counts[t] / weights[t])
    return tenant, counts[tenant], counts[tenant] / weights[tenant]
