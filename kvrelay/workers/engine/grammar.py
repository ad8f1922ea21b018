"""Structured output in the engine: grammars compiled once per spec, one matcher per sequence.

A constrained request's path: `add_request` -> `Grammars.submit(spec)` (an LRU of compiled
grammars for this engine's tokenizer, keyed by the normalized spec; a miss compiles on the
grammar thread pool, so `step()` never waits for it; a worker's reader thread compiles before
admission, see workers/reader.py) -> the sequence waits in the scheduler until
`GrammarState.poll()` finds its grammar compiled, copies it and replays the outputs the
request already has (a resumed request continues exactly where it was) -> each step the
sampler masks the row's logits with `allowed()` after penalties -> `advance(token)` after each
sampled token; once the grammar takes no further token the sequence finishes with "stop". A
matcher that fails on the way (a limit of the grammar engine reached at some step, which the
ingress's trial walks did not reach) sets `error`: the token is not output and the request
fails ("error"), it never ends "stop" with text that breaks its constraint.

The matchers are llguidance's (the engine vLLM's `guidance` backend uses); the token table is
built once from the tokenizer's tokenizer.json.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import torch

from kvrelay.core.structured import (
    InvalidStructuredOutput,
    StructuredOutput,
    matcher_error,
    parser_limits,
)
from kvrelay.core.tokenizer import Tokenizer
from kvrelay.workers.errors import InvalidRequestError

DEFAULT_CAPACITY = 128  # compiled grammars kept per engine


class Grammars:
    """Compiled grammars for one tokenizer: an LRU of template matchers (never advanced; each
    sequence advances a copy), compiled on a small thread pool."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        capacity: int = DEFAULT_CAPACITY,
        num_threads: int = 2,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.num_threads = num_threads
        self.num_hits = 0
        self.num_misses = 0
        self._lock = threading.Lock()
        self._table_lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, ...], cf.Future[llguidance.LLMatcher]] = OrderedDict()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._table: llguidance.LLTokenizer | None = None

    def submit(self, spec: StructuredOutput) -> cf.Future[llguidance.LLMatcher]:
        """The compiled grammar of `spec` (a done future on a hit); never blocks on a compile."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return future
            self.num_misses += 1
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The compiled grammar, waiting for it (IO threads); InvalidRequestError if it has none."""
        return self.submit(spec).result()

    def start(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A sequence's matcher state: ready once compiled, `replay` (tokens already emitted)
        consumed first."""
        return GrammarState(self.submit(spec), list(replay), self.vocab_size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = spec.check().grammar()
        except InvalidStructuredOutput as exc:
            raise InvalidRequestError(f"invalid structured output: {exc}", "structured") from None
        table = self._token_table()
        matcher = llguidance.LLMatcher(table, grammar, log_level=0, limits=parser_limits())
        error = matcher_error(matcher)
        if error is not None:
            raise InvalidRequestError(f"invalid structured output: {error}", "structured")
        return matcher

    def _token_table(self) -> llguidance.LLTokenizer:
        with self._table_lock:  # built once (~0.3 s), on the first compile
            if self._table is None:
                eos = list(self.tokenizer.eos_token_ids) or None
                self._table = llguidance.LLTokenizer(
                    self.tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._table


@dataclass(slots=True)
class GrammarState:
    """One sequence's place in its grammar (compute thread only)."""

    future: cf.Future[llguidance.LLMatcher]
    replay: list[int]
    vocab_size: int
    matcher: llguidance.LLMatcher | None = None
    error: str | None = None
    _settled: bool = field(default=False, repr=False)

    @property
    def ready(self) -> bool:
        """Compiled and replayed: the sequence may be scheduled."""
        return self.matcher is not None

    def poll(self) -> bool:
        """Settle once the compile is done: True when settled (`matcher` or `error` set)."""
        if self._settled:
            return True
        if not self.future.done():
            return False
        self._settled = True
        try:
            template = self.future.result()
        except Exception as exc:  # InvalidRequestError; anything else must not stop the loop
            self.error = str(exc)
            return True
        matcher = template.deep_copy()
        if self.replay and not matcher.consume_tokens(self.replay):
            self.error = (
                f"the tokens already emitted do not fit the grammar: {matcher_error(matcher)}"
            )
            return True
        self.replay = []
        self.matcher = matcher
        return True

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab_size] (EOS only where it may end).
        A matcher that fails here allows every token: the one sampled is refused by `advance`
        (an all-False mask would leave the sampler nothing to draw from)."""
        assert self.matcher is not None
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            return torch.ones(self.vocab_size, dtype=torch.bool)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(np.bool_)
        return torch.from_numpy(mask)

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; True once the grammar takes no further token. A matcher
        that fails (computing the mask or consuming the token) sets `error` instead: the
        sequence must fail, and `token_id` is not part of its output."""
        assert self.matcher is not None
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = f"the structured output constraint failed: {matcher_error(self.matcher)}"
        return self.error is None and self.matcher.is_stopped()
