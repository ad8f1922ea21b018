"""Speculative decoding that never changes the output.

Each step, before scheduling, the `Speculator` gives every decoding sequence a draft: up to
`max_draft` tokens it guesses will follow (prompt lookup, engine/ngram.py, or a draft model,
engine/draft_model.py). The step computes the sequence's last token and its draft in one
forward pass; row `j` of its logits is then exactly the row a one-token step would compute
after the first `j` draft tokens (the kernels are batch- and chunk-invariant). The engine
samples row 0 with the draw of output position `i` (seeded by `(seed, i)`), appends it like any
token and, while the sampled token equals the draft token and the request goes on, samples the
next row with the draw of position `i + 1`, and so on. Every appended token is therefore the
token plain decoding would have produced, greedy or sampled, with the same logprobs, and the
sequence's K/V past the accepted draft is simply recomputed by later steps.

How long a draft: a draft token costs a row of compute whether or not it is accepted. With
`B` decoding sequences a step costs about `T0 + B c` and yields `B` tokens, so an extra row
pays when the probability that it is accepted (the request's acceptance estimate `a` to the
power of its position `j`) exceeds `c B / (T0 + B c)`; `row_cost` is `c / T0` (measured, see
docs/internals.md "Speculative decoding"). At one stream short drafts are nearly free; at 32
streams only requests whose drafts are usually accepted draft at all. A request whose drafts
stop paying drafts nothing and drifts back toward the prior estimate, so it is probed again.

A draft model also runs a forward per draft position, costing `d T0` (the drafter's `cost`
`d`: its weights over the target's, engine/draft_model.py; 0 for prompt lookup). Shared by the
`B` sequences (as if all drafted that far), a draft token then costs `c + d T0 / B`, so a row
pays when `a ** j > (c B + d T0) / (T0 + B c)`. A draft model as large as the target (`d >= 1`)
never pays, and drafts nothing.
"""

from __future__ import annotations

from typing import Protocol

from kvrelay.core.enums import Speculation
from kvrelay.workers.engine.ngram import NgramIndex
from kvrelay.workers.engine.sequence import Sequence

# c / T0 (see the module docstring). CPU: SmolLM2-135M int8-weight-only, 2 threads, Zen 4
# (`python benchmarks/speculation.py --rows`): one row 8.2 ms, four 12.3, eight 21.3; the
# extra rows are FMA-bound. At one stream 0.15, 0.2 and 0.25 serve grounded prompts equally
# fast (1.45-1.51x); at 8 streams 0.15 still drafted where the rejected rows took CPU from the
# other workers (0.95-1.00x on open-ended chat), so 0.25 (docs/benchmarks.md "Speculative
# decoding"). A GPU step stays weight-bound far longer.
ROW_COST = {"cpu": 0.25, "cuda": 0.01}


def default_row_cost(device_type: str) -> float:
    return ROW_COST.get(device_type, ROW_COST["cpu"])


def resolve_speculation(mode: str, draft_model: str | None) -> Speculation:
    """`auto` -> `draft` with a draft model, else `ngram`; `draft` needs a draft model."""
    try:
        spec = Speculation(mode)
    except ValueError:
        choices = ", ".join(m.value for m in Speculation)
        raise ValueError(f"speculation must be one of {choices}, got {mode!r}") from None
    if spec is Speculation.AUTO:
        return Speculation.DRAFT if draft_model else Speculation.NGRAM
    if spec is Speculation.DRAFT and not draft_model:
        raise ValueError("speculation 'draft' needs a draft model (--draft-model)")
    return spec


class Drafter(Protocol):
    """A source of draft tokens."""

    cost: float  # its forward per draft position over a target step's fixed cost (see above)

    def draft(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Up to `lengths[i]` tokens guessed to follow `seqs[i].token_ids`, for each i."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` left the engine (finished, aborted, handed off) or lost its blocks."""
        ...


class NgramDrafter:
    """Prompt lookup: each sequence's own `NgramIndex` over its prompt and outputs."""

    cost = 0.0  # a dictionary lookup

    def __init__(self, min_n: int = 2, max_n: int = 4):
        NgramIndex(min_n, max_n)  # validates
        self.min_n = min_n
        self.max_n = max_n

    def draft(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, lengths, strict=True):
            index = seq.spec.ngram
            if index is None:
                index = seq.spec.ngram = NgramIndex(self.min_n, self.max_n)
            out.append(index.propose(seq.token_ids, k))
        return out

    def release(self, seq: Sequence) -> None:
        """Nothing to free: the index lives and dies with the sequence."""


class Speculator:
    """Chooses each decoding sequence's draft length and asks the drafter for the tokens."""

    def __init__(self, drafter: Drafter, max_draft: int, row_cost: float, max_model_len: int):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        if row_cost <= 0:
            raise ValueError(f"row_cost must be > 0, got {row_cost}")
        self.drafter = drafter
        self.max_draft = max_draft
        self.row_cost = row_cost
        self.max_model_len = max_model_len

    def propose(self, running: list[Sequence]) -> None:
        """Set `seq.draft` of every running sequence ([] for those that draft nothing)."""
        decoding = []
        for seq in running:
            seq.draft = []
            if seq.is_decoding:
                decoding.append(seq)
        if not decoding:
            return
        rb = self.row_cost * len(decoding)
        threshold = (rb + self.drafter.cost) / (1.0 + rb)
        seqs, lengths = [], []
        for seq in decoding:
            k = min(self._worth(seq.spec.acceptance, threshold), self._room(seq))
            if k > 0:
                seqs.append(seq)
                lengths.append(k)
            else:
                seq.spec.idle()
        if not seqs:
            return
        for seq, draft in zip(seqs, self.drafter.draft(seqs, lengths), strict=True):
            seq.draft = draft
            if not draft:
                seq.spec.idle()

    def _worth(self, acceptance: float, threshold: float) -> int:
        """Draft positions j (1-based) with acceptance ** j > threshold, at most max_draft."""
        j, p = 0, acceptance
        while j < self.max_draft and p > threshold:
            j += 1
            p *= acceptance
        return j

    def _room(self, seq: Sequence) -> int:
        """Draft tokens that can still become outputs: within max_tokens and the context."""
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
