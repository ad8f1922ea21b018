"""DecodeGraphs: the model's decode step (one new token per sequence) replayed as CUDA graphs.

A decode step of a small model is hundreds of short kernels; launched one by one from Python its
time is the launches'. Each batch size class (1, 2, 4, 8, then multiples of 8, then of 32) is
captured once, on its first use, over static input buffers; a step of `r` sequences replays the
class's graph with its rows padded to the class size. Padding rows write no K/V (slot -1) and
belong to no sequence (their query length is 0), so they attend to nothing; every kernel on
CUDA computes a row independently of the other rows (Triton linears, norms and attention), so
a replayed row is bitwise the row the eager path computes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvrelay.kernels import AttentionMetadata

if TYPE_CHECKING:
    from kvrelay.workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def batch_classes(max_batch: int) -> list[int]:
    """The captured batch sizes up to `max_batch` (which is always one)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 1, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """CUDA graphs of `model`'s decode forward for batch classes up to `max_batch`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: torch.Tensor,
        page_size: int,
        max_batch: int,
        max_model_len: int,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.max_model_len = max_model_len
        self.classes = batch_classes(max_batch)
        dev = kv_pool.device
        n, width = self.classes[-1], -(-max_model_len // page_size)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=dev)
        self.context = torch.zeros(n, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.disabled: str | None = None  # why graphs are off after a failed capture
        # RoPE tables grow inside the forward: at full size now, never inside a graph.
        model.rope_table(max_model_len)

    def size_for(self, num_seqs: int) -> int | None:
        """The class a step of `num_seqs` decode rows replays, None if it has none."""
        if self.disabled is not None or num_seqs > self.classes[-1]:
            return None
        return next(c for c in self.classes if c >= num_seqs)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            context_lens=self.context[:size],
            query_start_loc=self.starts[: size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        return self.model(
            self.ids[:size], self.positions[:size], self.kv_pool, meta, self.rows[:size]
        )

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up (compiles the kernels) and capture over inert inputs: no row writes or attends.
        self.slots.fill_(-1)
        self.context.zero_()
        self.starts.zero_()
        side = torch.cuda.Stream(self.kv_pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size)
        logger.info("captured the decode step for %d sequences as a CUDA graph", size)
        return graph, logits

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        size: int,
    ) -> torch.Tensor | None:
        """fp32 logits [r, vocab] of a decode step of r = len(input_ids) sequences (one row
        each, every row sampling), replayed at class `size`; None if the capture failed."""
        if size not in self.graphs:
            try:
                self.graphs[size] = self._capture(size)
            except Exception as exc:  # never fail a step over a graph: run it eagerly
                self.disabled = repr(exc)
                logger.warning("CUDA graph capture failed, decoding eagerly: %r", exc)
                return None
        graph, logits = self.graphs[size]
        r = int(input_ids.shape[0])
        width = int(meta.block_tables.shape[1])
        self.ids[:r].copy_(input_ids)
        self.positions[:r].copy_(positions)
        self.slots[:r].copy_(meta.slot_mapping)
        self.slots[r:size].fill_(-1)  # padding rows: no K/V written ...
        self.tables[:r, :width].copy_(meta.block_tables)
        self.context[:r].copy_(meta.context_lens)
        self.context[r:size].zero_()
        self.starts[: r + 1].copy_(meta.query_start_loc)
        self.starts[r + 1 : size + 1].fill_(r)  # ... and no query row attends
        graph.replay()
        return logits[:r]
