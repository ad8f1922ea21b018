"""Drafting with a smaller model of the same tokenizer (`speculation="draft"`, speculator.py).

The draft model runs greedy: its guesses only decide how many tokens a step accepts, never
which tokens come out (the engine verifies every draft token against the target's own sample).

Its K/V lives in a pool of its own with the target pool's shape in blocks: the same number of
blocks and page size, addressed by the target sequence's block table, so block `b` of a
sequence holds its target K/V in the target pool and its draft K/V in the draft pool. The
drafter therefore needs no allocator, and preemption frees both at once.

Bookkeeping, per sequence: `seq.spec.draft_computed` tokens of `seq.token_ids` have valid draft
K/V. A draft of `k` tokens first computes the tokens from there to the last one, whose last row
gives draft token 1, then `k - 1` one-token forwards (draft tokens 2..k); all sequences drafting
in a step share each forward. That first forward is a prefill of the whole prompt for a new
sequence (at most `max_num_batched_tokens` a step: one not caught up drafts nothing yet), later
the few tokens since its last draft. It leaves `draft_computed = num_tokens + k - 1`. The target
then accepts some draft tokens: the draft K/V beyond them is stale, so the next draft starts
from `min(draft_computed, num_computed_tokens)` (accepted draft tokens are exactly the tokens
there). `KVCacheManager.free` resets it to 0 (preemption); a prefix hit or store load brings
only target K/V, and a sequence starts at 0, so it recomputes its whole prefix in the draft
model. Two sequences sharing a cached block both write its draft K/V, with identical values
(same tokens, same positions, batch- and chunk-invariant kernels), so sharing is harmless.

Blocks: drafting runs before the scheduler allocates the step's slots, so the drafter allocates
the target's slots for the last token and the draft (`allocate_slots(seq, 1 + k)`: what the
scheduler would take for the step anyway) and drafts nothing when they are not free, leaving
every running sequence a block for its own next token (a draft never preempts anyone).

Cost: `cost` (the draft's matmul weights over the target's; a decode step is bound by reading
them) is what the Speculator's row-cost rule charges per draft position for the draft forward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from kvrelay.core.config import ConfigError
from kvrelay.workers.engine.config import EngineConfig
from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.model_runner import ModelRunner
from kvrelay.workers.engine.scheduler import ScheduledSeq, Scheduler
from kvrelay.workers.engine.sequence import Sequence
from kvrelay.workers.engine.speculator import matmul_params
from kvrelay.workers.model.llama import allocate_kv_pool
from kvrelay.workers.model.loader import load_model

if TYPE_CHECKING:
    from kvrelay.workers.model.loader import LoadedModel


class TargetEngine(Protocol):
    """What a draft model uses of the engine it drafts for (`llm_engine.Engine`): its model,
    KV pool and settings, and its KV blocks and running sequences (to leave them room)."""

    @property
    def loaded(self) -> LoadedModel: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def scheduler(self) -> Scheduler: ...


@dataclass(slots=True)
class _DraftView:
    """What `ModelRunner.prepare` reads of a sequence, over the draft model's progress:
    `token_ids` are the sequence's tokens and the draft so far."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    prompt_logprobs: None = None
    wants_prompt_logprobs: bool = False
    draft: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _as_seq(view: _DraftView) -> Sequence:
    """`view` where ScheduledSeq takes a Sequence: it has every field that
    `ModelRunner.prepare` and `draft` read of one."""
    return cast(Sequence, view)


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's id -> token table (added tokens included)."""
    h = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        h.update(f"{tokenizer.id_to_token(i)}\0".encode())
    return h.hexdigest()


class DraftModelDrafter:
    """Greedy drafts from `name`, loaded like the engine's model (device, dtype, quantization)."""

    def __init__(self, engine: TargetEngine, name: str):
        target = engine.loaded
        if target.config.kv_layout.groups[0].local:
            # the draft's K/V lives in group 0's block ids, whose pages behind the window
            # are released
            raise ConfigError(
                f"a draft model needs a target with full-attention layers; every layer of "
                f"{target.name} is sliding-window: use --speculation ngram"
            )
        draft = load_model(
            name,
            dtype=str(target.dtype).removeprefix("torch."),
            device=str(target.device),
            quantization=target.quantization,
        )
        check_same_vocabulary(target, draft)
        self.engine = engine
        self.loaded = draft
        pool = engine.runner.kv_pool
        kv_pool = allocate_kv_pool(
            draft.config, pool.shape[0], engine.config.page_size, pool.dtype, pool.device
        )
        self.runner = ModelRunner(draft.model, kv_pool, engine.config.page_size)
        self.max_tokens = engine.config.max_num_batched_tokens  # per catch-up forward
        # Longest context the draft model was trained for; past it a sequence drafts nothing.
        self.max_len = draft.config.max_position_embeddings
        # One draft forward over the target step's fixed cost (Speculator: row-cost rule).
        self.cost = matmul_params(draft.config) / matmul_params(target.config)

    def draft(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        kv = self.engine.kv
        # Blocks each running sequence needs for its own next token stay free for it.
        reserve = sum(kv.num_blocks_needed(s, 1) for s in self.engine.scheduler.running)
        budget = self.max_tokens
        chunks: list[tuple[Sequence, ScheduledSeq]] = []  # the catch-up forward
        drafting: list[tuple[Sequence, _DraftView, int]] = []  # ... those reaching their end
        for seq, k in zip(seqs, lengths, strict=True):
            k = min(k, self.max_len - seq.num_tokens + 1)  # positions written stay < max_len
            if k < 1 or budget <= 0:
                continue
            start = min(seq.spec.draft_computed, seq.num_computed_tokens)
            seq.spec.draft_computed = start
            n = min(seq.num_tokens - start, budget)
            view = _DraftView(seq.token_ids, seq.block_table, start)
            if start + n == seq.num_tokens:  # catches up: drafts this step, if blocks allow
                own = kv.num_blocks_needed(seq, 1)
                extra = kv.num_blocks_needed(seq, 1 + k) - own
                if extra > kv.pool.num_free_blocks - reserve or not kv.allocate_slots(seq, 1 + k):
                    continue
                reserve -= own
                view.token_ids = list(seq.token_ids)  # the draft is appended to this copy
                drafting.append((seq, view, k))
            chunks.append((seq, ScheduledSeq(_as_seq(view), n)))
            budget -= n
        if not chunks:
            return [[] for _ in seqs]
        self._forward([s for _, s in chunks], [v for _, v, _ in drafting])
        for seq, s in chunks:
            s.seq.num_computed_tokens += s.num_new_tokens
            seq.spec.draft_computed = s.seq.num_computed_tokens
        # One-token forwards: draft token j + 1 follows draft token j.
        while active := [(seq, v) for seq, v, k in drafting if len(v.draft) < k]:
            self._forward([ScheduledSeq(_as_seq(v), 1) for _, v in active], [v for _, v in active])
            for seq, view in active:
                view.num_computed_tokens += 1
                seq.spec.draft_computed = view.num_computed_tokens
        drafts = {id(seq): view.draft for seq, view, _ in drafting}
        return [drafts.get(id(seq), []) for seq in seqs]

    def _forward(self, sched: list[ScheduledSeq], sampling: list[_DraftView]) -> None:
        """Run `sched`; append each sampling view's greedy next token to its draft (and
        tokens). `sampling` are the views whose chunk reaches their last token, in order."""
        logits = self.runner.run(sched).sample
        for view, token in zip(sampling, logits.argmax(dim=-1).tolist(), strict=True):
            view.draft.append(token)
            view.token_ids.append(token)

    def release(self, seq: Sequence) -> None:
        """Nothing to free: the draft K/V lives in the sequence's own (target) block ids."""
        seq.spec.draft_computed = 0


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose token ids mean other tokens than the target's."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(
            f"draft model {draft.name!r} has a vocabulary of {draft.config.vocab_size} tokens, "
            f"the model {target.name!r} {target.config.vocab_size}: they must share a tokenizer"
        )
    if vocab_fingerprint(draft.tokenizer) != vocab_fingerprint(target.tokenizer):
        raise ConfigError(
            f"draft model {draft.name!r} has another tokenizer than {target.name!r} "
            "(same size, other tokens): they must share a tokenizer"
        )
