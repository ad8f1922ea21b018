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

Two more terms make the step's cost what it is on a CPU (`StepCost`):
- Context. A decoding sequence reads its whole K/V every step, and its draft rows share that
  read (one attention unit takes all of a sequence's query rows): with `KV` bytes of context
  the step costs `T0 (1 + KV / F) + B c`, where `F` is the step's fixed cost in bytes read
  (`fixed_step_bytes`: the weights plus what the rest of a step costs, measured). At 8 x 4,000
  tokens of context a SmolLM2 decode step took 48.8 ms against 16.7 at 8 x 600 (AMX host,
  w8a16, bf16 K/V); the rows cost the same, so long contexts make drafts cheap.
- Free rows. Linears on AMX tiles (`w8a16`) take up to 32 rows at one cost (two A tiles), so
  the first `free_rows` rows of a step do not add `c`: B sequences cost `T0 + c max(0, B -
  free_rows)`. Measured (same host, 600-token contexts): 8 x 1 rows 16.7 ms, 8 x 4 19.3; 32 x 1
  35.5, 32 x 2 55.2 (c = 0.62 ms, T0 ~ 15.7: c / T0 0.04).
So a row pays when `a ** j > (c B + d T0) / (T0 (1 + KV / F) + c max(0, B - free_rows))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvrelay.core.enums import Quantization, Speculation
from kvrelay.workers.engine.ngram import NgramIndex
from kvrelay.workers.engine.sequence import Sequence
from kvrelay.workers.model.config import ModelConfig

# c / T0 (see the module docstring). CPU: SmolLM2-135M int8-weight-only, 2 threads, Zen 4
# (`python benchmarks/speculation.py --rows`): one row 8.2 ms, four 12.3, eight 21.3; the
# extra rows are FMA-bound. At one stream 0.15, 0.2 and 0.25 serve grounded prompts equally
# fast (1.45-1.51x); at 8 streams 0.15 still drafted where the rejected rows took CPU from the
# other workers (0.95-1.00x on open-ended chat), so 0.25 (docs/benchmarks.md "Speculative
# decoding"). A GPU step stays weight-bound far longer.
ROW_COST = {"cpu": 0.25, "cuda": 0.01}
# w8a16 linears on AMX tiles (measured as in the module docstring): c / T0 and the rows a step
# takes at one cost.
W8A16_ROW_COST, W8A16_FREE_ROWS = 0.04, 32
# What a CPU decode step costs besides reading its weights, in bytes read at the same speed:
# SmolLM2-135M w8a16 on an AMX host took T0 ~ 15.7 ms, ~320 MB of K/V reads at its ~20 GB/s,
# of which its linear weights are 134 MB (Python, sampling, norms and launches are the rest).
CPU_STEP_OVERHEAD_BYTES = 192 << 20
# Bytes per linear weight by quantization (int8 kinds: 1; fp16: 2; none: the model dtype).
WEIGHT_BYTES = {Quantization.FP16: 2}


def default_row_cost(device_type: str, quantization: str = Quantization.NONE) -> float:
    if device_type == "cpu" and quantization == Quantization.W8A16:
        return W8A16_ROW_COST
    return ROW_COST.get(device_type, ROW_COST["cpu"])


def default_free_rows(device_type: str, quantization: str) -> int:
    """Rows a step's linears take at one cost (see the module docstring)."""
    return W8A16_FREE_ROWS if device_type == "cpu" and quantization == Quantization.W8A16 else 0


def matmul_params(config: ModelConfig) -> int:
    """Weights a token's forward multiplies by (attention, MLP, LM head; not the embedding
    lookup): a decode step is bound by reading them, so their ratio is a step-cost ratio."""
    c = config
    kv = c.num_kv_heads * c.head_dim
    q = c.num_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def fixed_step_bytes(config: ModelConfig, quantization: str, dtype_bytes: int) -> int:
    """A CPU decode step's fixed cost `F` in bytes read: its linear weights (`matmul_params`)
    plus CPU_STEP_OVERHEAD_BYTES."""
    weights = matmul_params(config)
    if quantization == Quantization.NONE:
        per_weight = dtype_bytes
    else:
        per_weight = WEIGHT_BYTES.get(Quantization(quantization), 1)
    return weights * per_weight + CPU_STEP_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class StepCost:
    """What a decode step costs, relative to its fixed cost T0 (the module docstring)."""

    row_cost: float  # c / T0
    free_rows: int = 0  # rows the step's linears take at one cost
    fixed_bytes: float = math.inf  # F: T0 in bytes of K/V read (inf: context is free)
    kv_bytes_per_token: int = 0

    def threshold(self, batch: int, context_tokens: int, drafter_cost: float) -> float:
        """Acceptance probability above which a draft row pays, for `batch` decoding sequences
        holding `context_tokens` tokens of K/V in all."""
        rb = self.row_cost * batch
        base = 1.0 + self.row_cost * max(0, batch - self.free_rows)
        base += context_tokens * self.kv_bytes_per_token / self.fixed_bytes
        return (rb + drafter_cost) / base


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

    def __init__(self, drafter: Drafter, max_draft: int, cost: StepCost, max_model_len: int):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        if cost.row_cost <= 0:
            raise ValueError(f"row_cost must be > 0, got {cost.row_cost}")
        self.drafter = drafter
        self.max_draft = max_draft
        self.cost = cost
        self.max_model_len = max_model_len

    @property
    def row_cost(self) -> float:
        return self.cost.row_cost

    def propose(self, running: list[Sequence]) -> None:
        """Set `seq.draft` of every running sequence ([] for those that draft nothing)."""
        decoding = []
        for seq in running:
            seq.draft = []
            if seq.is_decoding:
                decoding.append(seq)
        if not decoding:
            return
        context = sum(seq.num_computed_tokens for seq in decoding)
        threshold = self.cost.threshold(len(decoding), context, self.drafter.cost)
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
