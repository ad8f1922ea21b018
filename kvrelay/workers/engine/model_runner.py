"""Turns one scheduler step into model inputs (token ids, positions, attention metadata), runs
the forward and returns the logits of the rows that sample (and, for prompt_logprobs requests,
of their prompt positions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kvrelay.core.kv_layout import KVLayout
from kvrelay.kernels import AttentionMetadata
from kvrelay.workers.engine.cuda_graphs import DecodeGraphs
from kvrelay.workers.engine.scheduler import ScheduledSeq
from kvrelay.workers.engine.sequence import Sequence
from kvrelay.workers.model.lora import LoraRows, LoraSet

if TYPE_CHECKING:
    from kvrelay.workers.model.llama import LlamaForCausalLM


@dataclass(slots=True)
class PromptRows:
    """Logits rows of one prompt_logprobs sequence: row `i` predicts prompt token `first + i`."""

    seq: Sequence
    first: int
    num_rows: int
    start_row: int = 0  # in the step's logits


@dataclass(slots=True)
class StepLogits:
    """float32 logits: `sample` `[sampling rows, vocab]` (1 + len(draft) rows per sampling
    sequence, in step order; on CPU, except a CUDA-graph decode step's, left on the GPU for
    the sampler), and each prompt_logprobs sequence's prompt rows (CPU)."""

    sample: torch.Tensor
    prompt: list[tuple[PromptRows, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the KV pool `[num_blocks, layers, 2, page_size, kv_heads, head_dim]`
    (with a `layout` of KV groups, `layers` is its group size: one metadata per group)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: torch.Tensor,
        page_size: int,
        attention_precision: str = "fp32",
        layout: KVLayout | None = None,
        loras: LoraSet | None = None,
    ):
        self.model = model
        self.loras = loras  # sequences' LoRA adapters (none on a draft model's runner)
        self.num_groups = 1 if layout is None else layout.num_groups
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.attention_precision = attention_precision  # every step's metadata says it
        self.device = kv_pool.device
        self.graphs: DecodeGraphs | None = None  # CUDA: decode steps replayed as graphs

    def use_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Replay decode steps of up to `max_batch` sequences as CUDA graphs."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_pool, self.page_size, max_batch, max_model_len
        )

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata | list[AttentionMetadata],
        torch.Tensor,
        list[PromptRows],
    ]:
        """(input_ids, positions, metadata, logits_indices, prompt rows) for one step: a
        sequence collecting prompt logprobs adds the rows of its prompt positions not yet
        collected (once each, even when recomputed after a preemption) before its sampling
        row; a sequence with a draft has a sampling row for its last token and one per draft
        token; the indices are sorted, sampling rows are the others. With KV groups the
        metadata is a list, one per group (a local group's released entries read as block 0:
        the kernels read no page wholly behind a window)."""
        P = self.page_size
        num_seqs = len(scheduled)
        G = self.num_groups
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        context_lens = np.empty(num_seqs, dtype=np.int32)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_tables = [np.zeros((num_seqs, max_blocks), dtype=np.int32) for _ in range(G)]
        logits_indices: list[int] = []
        prompt_rows: list[PromptRows] = []
        for i, s in enumerate(scheduled):
            seq, n, draft = s.seq, s.num_new_tokens, s.draft
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start : end - len(draft)])
            ids.extend(draft)
            pos_parts.append(np.arange(start, end, dtype=np.int64))
            block_tables[0][i, : len(seq.block_table)] = seq.block_table
            for g in range(1, G):
                table = seq.group_tables[g - 1]
                block_tables[g][i, : len(table)] = table
            context_lens[i] = end
            query_start[i + 1] = query_start[i] + n
            if seq.wants_prompt_logprobs:
                # token k is predicted at position k - 1; tokens already collected are skipped
                collected = cast("list[dict[str, Any]]", seq.prompt_logprobs)  # wanted: a list
                first = max(start, len(collected) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    row = PromptRows(seq, first + 1, last - first, len(logits_indices))
                    prompt_rows.append(row)
                    base = int(query_start[i]) - start
                    logits_indices.extend(range(base + first, base + last))
            if end - len(draft) == seq.num_tokens:  # the last token's row, then the draft's
                last = int(query_start[i + 1])
                logits_indices.extend(range(last - 1 - len(draft), last))
        positions = np.concatenate(pos_parts)
        rows = np.repeat(np.arange(num_seqs), np.diff(query_start))  # each token's sequence
        page, offset = positions // P, positions % P
        slot_mappings = []
        for tables in block_tables:
            np.maximum(tables, 0, out=tables)  # a released entry (-1) reads block 0
            slot_mappings.append(tables[rows, page].astype(np.int64) * P + offset)
        dev = self.device
        lens = torch.from_numpy(context_lens).to(dev)
        starts = torch.from_numpy(query_start).to(dev)
        metas = [
            AttentionMetadata(
                slot_mapping=torch.from_numpy(slot_mappings[g]).to(dev),
                block_tables=torch.from_numpy(block_tables[g]).to(dev),
                context_lens=lens,
                query_start_loc=starts,
                max_query_len=int(np.diff(query_start).max()),
                max_context_len=int(context_lens.max()),
                precision=self.attention_precision,
            )
            for g in range(G)
        ]
        meta = metas[0] if G == 1 else metas
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return (
            input_ids,
            torch.from_numpy(positions).to(dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
            prompt_rows,
        )

    def lora_rows(self, scheduled: list[ScheduledSeq]) -> LoraRows | None:
        """The step's token rows by LoRA adapter (None: no sequence has one)."""
        if self.loras is None:
            return None
        return self.loras.rows(
            [s.seq.lora for s in scheduled], [s.num_new_tokens for s in scheduled]
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """Compute K/V of the scheduled tokens; their logits (sampling and prompt rows)."""
        input_ids, positions, meta, logits_indices, prompt_rows = self.prepare(scheduled)
        lora = self.lora_rows(scheduled)
        num = len(scheduled)
        if (
            self.graphs is not None
            and lora is None
            and isinstance(meta, AttentionMetadata)
            and meta.max_query_len == 1
            and not prompt_rows
            and logits_indices.shape[0] == num  # every sequence samples its one row
        ):
            size = self.graphs.size_for(num)
            if size is not None:
                logits = self.graphs.run(input_ids, positions, meta, size)
                if logits is not None:  # left on the GPU: greedy rows need only the argmax
                    return StepLogits(logits)
        logits = self.model(input_ids, positions, self.kv_pool, meta, logits_indices, lora)
        logits = logits.float().cpu()
        if not prompt_rows:
            return StepLogits(logits)
        keep = torch.ones(logits.shape[0], dtype=torch.bool)
        prompt = []
        for rows in prompt_rows:
            span = slice(rows.start_row, rows.start_row + rows.num_rows)
            keep[span] = False
            prompt.append((rows, logits[span]))
        return StepLogits(logits[keep], prompt)
