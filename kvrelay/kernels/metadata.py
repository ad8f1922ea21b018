"""Per-step attention metadata shared by the model, the engine and the kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which query rows attend to which paged context."""

    slot_mapping: torch.Tensor  # int64 [T]: pool slot of each new token, negative = skip
    block_tables: torch.Tensor  # int32 [S, max_blocks]: block ids of each sequence
    context_lens: torch.Tensor  # int32 [S]: tokens in context incl. this step's new tokens
    query_start_loc: torch.Tensor  # int32 [S + 1]: prefix sums of query rows per sequence
    max_query_len: int
    max_context_len: int
    # How the attention's dot products compute: "fp32", or "bf16" (q and p rounded to bf16, AMX
    # tiles; ops.paged_attention). One value per engine: it is part of its pages' fingerprint.
    precision: str = "fp32"
    # Kernel-private index plans derived from the fields above, built once per step and
    # reused by every layer. Do not mutate the tensors above after the first kernel call.
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
