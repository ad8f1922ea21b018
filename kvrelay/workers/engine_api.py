"""What a worker process uses of its engine: the `EngineAPI` protocol.

The prefill and decode workers (`workers.base` and its helpers: the reader thread, the
metrics, the model publication) drive an engine only through these members;
`kvrelay.workers.engine.llm_engine.Engine` is the one that serves, and mypy checks that it
fits where `kvrelay worker` hands it to a worker. The protocol is structural: anything with
these members (a stand-in in a test) is an engine to a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvrelay.core.enums import FinishReason, Speculation
from kvrelay.core.messages import Retention
from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import StructuredOutput
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.config import EngineConfig, EngineStats, RequestOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.workers.model.loader import LoadedModel
    from kvrelay.workers.model.lora import LoraSet


class GrammarCompiler(Protocol):
    """The engine's grammar cache, as the reader thread uses it."""

    def compile(self, spec: StructuredOutput) -> object:
        """Compile `spec` (waiting for it) into the cache; InvalidRequestError if it has none."""
        ...


class BlockPoolOwner(Protocol):
    """An engine as the worker metrics read it: its KV block pool (`kv_cache_usage_perc`)."""

    @property
    def pool(self) -> BlockPool: ...


class EngineAPI(BlockPoolOwner, Protocol):
    """The engine of a worker process (see kvrelay.workers.engine.llm_engine.Engine)."""

    # ---- identity, published by the heartbeat and the model publication ------------------
    @property
    def model_name(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def config(self) -> EngineConfig: ...  # page_size

    @property
    def loaded(self) -> LoadedModel: ...  # dir: the tokenizer files to publish

    @property
    def kernel_isa(self) -> str: ...  # the C++ CPU kernel build that runs ("": none)

    @property
    def loras(self) -> LoraSet: ...  # its LoRA adapters (published; loaded at run time)

    @property
    def kv_dtype(self) -> torch.dtype: ...  # the KV pool's dtype

    @property
    def speculation(self) -> Speculation: ...  # speculative decoding, resolved

    @property
    def attention_precision(self) -> str: ...  # "fp32" or "bf16" (AMX tiles), resolved

    # ---- state ---------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats: ...  # counters since start (speculation metrics)

    @property
    def grammars(self) -> GrammarCompiler: ...  # structured output: compiled by the reader

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        cache_salt: str = "",
        retention: Retention | None = None,
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
        lora: str = "",
        handoff_after: int | None = None,
        emitted_text_len: int | None = None,
        sampling_checked: bool = False,
    ) -> None:
        """Queue a request; raises InvalidRequestError for input no engine could serve."""
        ...

    def abort_request(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        """Drop a request; its final output, or None if it is unknown or done."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: the new tokens of every request that got one."""
        ...
