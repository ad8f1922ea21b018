"""Engine configuration and output dataclasses (see docs/internals.md "Engine")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.enums import FinishReason, Quantization, Speculation
from kvrelay.core.modelref import DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    num_blocks: int | None = None  # default: kv_cache_bytes // bytes per block
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    enable_prefix_caching: bool = True
    save_to_store: bool = True
    quantization: str = Quantization.NONE  # any but none: CPU fp32 only
    # KV pool dtype: auto | fp32 | bf16 | fp16 (or float32/bfloat16/float16); auto = bf16 for an
    # fp32 model on CPU with the C++ kernels, else the model dtype (loader.resolve_kv_dtype_name).
    # 16-bit pages halve the pool's bytes per token.
    kv_cache_dtype: str = "auto"
    # Attention dot products: fp32 | bf16 | auto (loader.resolve_attention_precision). bf16
    # rounds q and p to bf16 for AMX-BF16 tiles (CPU, bf16 pages; other bits than fp32, so a
    # part of the fingerprint); auto = bf16 where it runs. `kvrelay up` and workers default to
    # auto; the engine alone keeps fp32, the same bits on every host.
    attention_precision: str = "fp32"
    # Speculative decoding (engine/speculator.py), never changing the output: auto | off |
    # ngram | draft (auto: draft with a draft_model, else ngram); drafts of up to
    # num_speculative_tokens tokens, as long as each row is likely enough to pay.
    speculation: str = Speculation.AUTO
    num_speculative_tokens: int = 6
    prompt_lookup_min: int = 2  # n-gram lengths matched, longest first (vLLM's names)
    prompt_lookup_max: int = 4
    draft_model: str | None = None  # same tokenizer as `model`; loaded like it
    spec_row_cost: float = 0.0  # a row's cost over a step's fixed cost; 0: the kernels' default
    cuda_graphs: bool = True  # on CUDA, decode steps replay CUDA graphs (engine/cuda_graphs.py)
    # LoRA adapters (model/lora.py, PEFT directories): name=path items, loaded at start; at
    # most max_loras held at once (loaded at start or at run time), each of rank up to
    # max_lora_rank
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request from one step (or, from `generate`, all of them)."""

    request_id: str
    index: int  # output index of new_token_ids[0]
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    handoff: bool
    output_token_ids: list[int]  # every output so far (resumed ones included)
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: dict[str, Any] = field(default_factory=dict)
    # with the first output: the prompt tokens' logprobs (Sequence.prompt_logprobs)
    prompt_logprobs: list[dict[str, Any]] | None = None
    error: str | None = None  # why a request finished with "error" (its grammar failed)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V this engine computed (prefill + decode)
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # ... and accepted (each an output token)
    num_verifications: int = 0  # sequence-steps that verified a draft


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """`b` extended with the earlier tokens, logprobs and text of `a` (same request)."""
    lps = None
    if a.new_logprobs is not None or b.new_logprobs is not None:
        lps = (a.new_logprobs or []) + (b.new_logprobs or [])
    b.index = a.index
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_logprobs = lps
    b.text_delta = a.text_delta + b.text_delta
    if b.prompt_logprobs is None:
        b.prompt_logprobs = a.prompt_logprobs
    return b
