"""Token sampler: penalties, temperature, min-p, top-k, top-p, logprobs, counter-based draws.

Order of processing (vLLM v1's): raw logprobs are taken first (the model's distribution, before
any penalty or temperature, which is vLLM's default `raw_logprobs`); then stop tokens are masked
while `min_tokens` is not reached and `logit_bias` is added; then repetition, frequency and
presence penalties; then a structured-output row's grammar mask (tokens the grammar does not
allow next get -inf); greedy rows take the argmax of those processed logits; random rows divide
by the temperature, apply min-p, then top-k, then top-p (over the top-k renormalised
distribution, as vLLM does) and draw.

Reproducibility: the draw for output position `i` uses one uniform number computed from
`(seed, i)` alone (a blake2b counter, no generator state), mapped through the inverse CDF of
the candidate distribution. A request restarted at any position, alone or in any batch,
therefore draws the same number; every per-row op is row-local, so the token matches too.

The random rows of a step are drawn in one call of the C++ kernel `kernels.sample_rows`
(temperature, min-p, top-k, top-p and the draw, each row alone in a fixed order, the same bits
on every ISA variant; only the tokens above a probability threshold are sorted), after the
per-row processing above; where the kernels are not built, the torch path below draws them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrelay import kernels
from kvrelay.core.sampling import SamplingParams

# Top-p without top-k: sort only the best `k` tokens, growing k until they hold top_p of the
# mass (a full sort of a 49k vocabulary costs ~4 ms per row on this CPU).
_TOP_P_FIRST_K = 256
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows.
_MIN_TEMPERATURE = 1e-5


def uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) used for output position `index` of a request."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one request for the token at output `index`."""

    params: SamplingParams
    seed: int
    index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()  # masked (min_tokens not reached yet)
    allowed_token_mask: torch.Tensor | None = None  # structured output: bool [vocab], CPU


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None = field(default=None)


def _apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """`logits` with each biased token's bias added (a new tensor; row-local)."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), dtype=torch.long)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits.index_add(0, ids, values)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    p = row.params
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        if row.prompt_token_ids:
            seen[torch.as_tensor(row.prompt_token_ids, dtype=torch.long)] = True
        if row.output_token_ids:
            seen[torch.as_tensor(row.output_token_ids, dtype=torch.long)] = True
        penalised = torch.where(
            logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
        counts = torch.bincount(
            torch.as_tensor(row.output_token_ids, dtype=torch.long), minlength=vocab
        ).to(logits.dtype)
        logits = logits - p.frequency_penalty * counts
        logits = logits - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _candidates(
    logits: torch.Tensor, p: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probabilities, token ids or None for the whole vocabulary in id order)."""
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    vocab = logits.shape[0]
    if p.top_k > 0:
        values, ids = torch.topk(logits, min(p.top_k, vocab))
        probs = torch.softmax(values, dim=-1)
    elif p.top_p < 1.0:
        lse = torch.logsumexp(logits, dim=-1)
        k = min(_TOP_P_FIRST_K, vocab)
        while True:
            values, ids = torch.topk(logits, k)
            probs = torch.exp(values - lse)
            if k == vocab or float(probs.sum()) >= p.top_p:
                break
            k = min(k * 4, vocab)
    else:
        return torch.softmax(logits, dim=-1), None
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        keep = int(((cum - probs) < p.top_p).sum())
        probs, ids = probs[: max(keep, 1)], ids[: max(keep, 1)]
    return probs, ids


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, u: float) -> int:
    cum = torch.cumsum(probs, dim=-1)
    target = torch.tensor([u], dtype=cum.dtype) * cum[-1]
    pos = int(torch.searchsorted(cum, target, right=True)[0])
    pos = min(pos, cum.shape[0] - 1)
    while float(probs[pos]) == 0.0 and pos > 0:  # float rounding at the very top: step back
        pos -= 1
    return pos if ids is None else int(ids[pos])


def _logprobs(raw: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    lp = torch.log_softmax(raw, dim=-1)
    out = {token_id: float(lp[token_id])}
    if n > 0:
        values, ids = torch.topk(lp, n)
        for tok, val in zip(ids.tolist(), values.tolist(), strict=True):
            out.setdefault(tok, val)
    return out


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], n: int) -> list[dict]:
    """Raw logprobs of `token_ids[i]` under row `i` of `logits` `[rows, vocab]` (the position
    before it), with its rank (tokens at least as likely, itself included: vLLM's) and the
    top-n: TokenChunk entries. Row-local, so batch invariant."""
    lp = torch.log_softmax(logits, dim=-1)
    ids = torch.as_tensor(token_ids, dtype=torch.long)[:, None]
    chosen = lp.gather(1, ids)
    ranks = (lp >= chosen).sum(dim=-1)
    top_values, top_ids = torch.topk(lp, n) if n > 0 else (lp[:, :0], ids[:, :0])
    return [
        {
            "token_id": tok,
            "logprob": value,
            "rank": rank,
            "top": [[i, v] for i, v in zip(top_i, top_v, strict=True)],
        }
        for tok, value, rank, top_i, top_v in zip(
            token_ids,
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            strict=True,
        )
    ]


class Sampler:
    """Samples one token per row of a float32 logits matrix `[rows, vocab]` (on CPU, or on
    the GPU for a CUDA-graph decode step: plain greedy rows take their argmax there)."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampleResult]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sample rows")
        plain_greedy = [_is_plain(r) and r.params.temperature < _MIN_TEMPERATURE for r in rows]
        greedy_ids: list[int] = []
        if all(plain_greedy) and rows:
            # The common case in one op: argmax is row-local, so it is batch invariant; on the
            # GPU only the ids come back (the first maximum's, as on CPU). On CPU `max` gives
            # the same first maximum 2.5x faster than `argmax` (32 x 49,152: 0.5 vs 1.3 ms).
            if logits.is_cpu:
                greedy_ids = logits.max(dim=-1).indices.tolist()
            else:
                greedy_ids = logits.argmax(dim=-1).tolist()
        if not logits.is_cpu and (
            not greedy_ids or any(r.params.logprobs is not None for r in rows)
        ):
            logits = logits.cpu()  # the per-row processing below runs on CPU
        tokens = greedy_ids or self._tokens(logits, rows)
        results: list[SampleResult] = []
        for i, row in enumerate(rows):
            lps = None
            if row.params.logprobs is not None:
                lps = _logprobs(logits[i], tokens[i], row.params.logprobs)
            results.append(SampleResult(tokens[i], lps))
        return results

    def _tokens(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """Each row's token: greedy rows their argmax, random rows drawn together."""
        tokens = [0] * len(rows)
        drawn: list[int] = []
        drawn_logits: list[torch.Tensor] = []
        every_row_raw = True  # every row drawn, none processed: the logits are the batch
        for i, row in enumerate(rows):
            plain = _is_plain(row)
            processed = logits[i] if plain else _processed(logits[i], row)
            if row.params.temperature < _MIN_TEMPERATURE:
                tokens[i] = int(processed.argmax())
                every_row_raw = False
            else:
                drawn.append(i)
                drawn_logits.append(processed)
                every_row_raw = every_row_raw and plain
        if drawn:
            batch = logits if every_row_raw else torch.stack(drawn_logits)
            for i, token in zip(drawn, _draw_rows(batch, [rows[i] for i in drawn]), strict=True):
                tokens[i] = token
        return tokens


def _processed(raw: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """A row's logits after min_tokens' bans, logit_bias, penalties and its grammar's mask."""
    logits = raw
    if row.banned_token_ids:
        logits = logits.clone()
        logits[torch.as_tensor(row.banned_token_ids, dtype=torch.long)] = float("-inf")
    logits = _apply_logit_bias(logits, row.params.logit_bias)
    logits = _apply_penalties(logits, row)
    if row.allowed_token_mask is not None:
        logits = _grammar_masked(raw, logits, row)
    return logits


def _draw_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """The tokens drawn for random rows (logits [R, V], processed): the C++ kernel, or torch."""
    settings = torch.tensor(
        [
            [r.params.temperature, r.params.top_p, r.params.min_p, uniform(r.seed, r.index)]
            for r in rows
        ],
        dtype=torch.float32,
    )
    top_k = torch.tensor([max(r.params.top_k, 0) for r in rows], dtype=torch.int64)
    ids = kernels.sample_rows(logits, settings, top_k) if logits.is_cpu else None
    if ids is not None:
        return ids.tolist()
    drawn = []
    for i, row in enumerate(rows):
        probs, cand = _candidates(logits[i] / row.params.temperature, row.params)
        drawn.append(_draw(probs, cand, uniform(row.seed, row.index)))
    return drawn


def _grammar_masked(raw: torch.Tensor, logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """`logits` with the tokens the row's grammar does not allow at -inf."""
    assert row.allowed_token_mask is not None
    disallowed = ~row.allowed_token_mask.to(logits.device)
    masked = logits.masked_fill(disallowed, float("-inf"))
    if row.banned_token_ids and not bool(torch.isfinite(masked).any()):
        # min_tokens banned every token the grammar allows (stop_token_ids): the grammar wins,
        # as an output that breaks it would be worse than an early stop token
        unbanned = _apply_penalties(_apply_logit_bias(raw, row.params.logit_bias), row)
        masked = unbanned.masked_fill(disallowed, float("-inf"))
    return masked


def _is_plain(row: SampleRow) -> bool:
    p = row.params
    return (
        row.allowed_token_mask is None
        and not row.banned_token_ids
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
    )
