"""The in-process LLM engine: continuous batching over a paged KV pool with prefix caching.

A request's path: `add_request` validates it and queues a Sequence -> each `step()` the
scheduler picks sequences and token counts (a structured-output request once its grammar is
compiled, engine/grammar.py) -> the model runner computes their K/V (prefix hits from the
device cache or the store are skipped) -> rows that reached their last token sample one token
(masked by their grammar, if any) -> the output processor detokenizes and checks stops -> full
blocks are keyed, registered and saved once -> a finished (or handed-off) sequence releases its
blocks. A prompt_logprobs request computes its whole prompt (no prefix hits) and keeps every
prompt position's logprobs, sent with its first output.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import operator
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, cast

import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.enums import FinishReason, Speculation
from kvrelay.core.limits import bad_token_id, context_overflow, token_id_message
from kvrelay.core.messages import Retention
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams, effective_seed
from kvrelay.kernels import loaded_isa
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.config import EngineConfig, EngineStats, RequestOutput, merge_outputs
from kvrelay.workers.engine.grammar import Grammars
from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.kv_connector import KVConnector
from kvrelay.workers.engine.model_runner import ModelRunner
from kvrelay.workers.engine.output_processor import OutputProcessor
from kvrelay.workers.engine.sampler import Sampler, SampleRow, prompt_logprobs
from kvrelay.workers.engine.scheduler import ScheduledSeq, Scheduler
from kvrelay.workers.engine.sequence import Sequence, SequenceStatus
from kvrelay.workers.engine.speculator import (
    Drafter,
    NgramDrafter,
    Speculator,
    StepCost,
    default_free_rows,
    default_row_cost,
    fixed_step_bytes,
    resolve_speculation,
)
from kvrelay.workers.errors import EngineError, InvalidRequestError, LoraError
from kvrelay.workers.model.lora import LoraSet, parse_modules

if TYPE_CHECKING:
    from kvrelay.workers.model.loader import LoadedModel

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput"]


class Engine:
    """See docs/internals.md "Engine"."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        kv_connector: KVConnector | None = None,
        *,
        loaded: LoadedModel | None = None,
        populate_kv: bool = True,
    ):
        """`loaded`: reuse an already loaded model (several engines sharing weights, tests);
        `populate_kv` False: the KV pool's pages are faulted in when `populate_kv_pool` is
        called (a worker: once it serves), not from now on."""
        from kvrelay.core.modelref import (
            model_fingerprint,
            normalize_attention_precision,
            normalize_kv_cache_dtype,
        )
        from kvrelay.workers.model.llama import allocate_kv_pool
        from kvrelay.workers.model.loader import (
            load_model,
            resolve_attention_precision,
            resolve_kv_dtype,
        )

        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {config.page_size}")
        try:  # a bad value fails before the model loads
            normalize_kv_cache_dtype(config.kv_cache_dtype)
            normalize_attention_precision(config.attention_precision)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if loaded is None:
            loaded = load_model(
                config.model,
                dtype=config.dtype,
                device=config.device,
                quantization=config.quantization,
            )
        elif loaded.quantization != config.quantization:
            raise ValueError(
                f"the loaded model has quantization {str(loaded.quantization)!r}, "
                f"the config asks for {str(config.quantization)!r}"
            )
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.kv_dtype = kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, loaded.dtype, loaded.device
        )
        mc = loaded.config
        try:
            self.attention_precision = attention = resolve_attention_precision(
                config.attention_precision,
                _dtype_name(kv_dtype),
                _dtype_name(loaded.dtype),
                loaded.device.type,
                config.page_size,
                mc.head_dim,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # Pages of another dtype, or computed with bf16 attention, are other pages: both are
        # part of their identity.
        self.fingerprint = loaded.fingerprint
        if kv_dtype != loaded.dtype or attention != "fp32":
            self.fingerprint = model_fingerprint(
                loaded.dir,
                _dtype_name(loaded.dtype),
                loaded.quantization,
                _dtype_name(kv_dtype),
                attention,
            )
        self.vocab_size = mc.vocab_size
        limit = mc.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        P = config.page_size
        self.kv_bytes_per_token = (
            mc.num_layers
            * 2
            * mc.num_kv_heads
            * mc.head_dim
            * torch.empty((), dtype=kv_dtype).element_size()
        )
        # KV groups (core.kv_layout): a block holds one page of `group_size` layers
        self.kv_layout = layout = mc.kv_layout
        block_bytes = self.kv_bytes_per_token * P * layout.group_size // mc.num_layers
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // block_bytes)
        kv_pool = allocate_kv_pool(
            mc, num_blocks, P, kv_dtype, loaded.device, layout, populate=populate_kv
        )
        self.loras = self._loras(config, loaded.model)
        self.runner = ModelRunner(loaded.model, kv_pool, P, attention, layout, loras=self.loras)
        if loaded.device.type == "cuda" and config.cuda_graphs:
            if layout.num_groups == 1:
                self.runner.use_cuda_graphs(config.max_num_seqs, self.max_model_len)
            else:  # one block table per group: the graphs capture one
                logger.info("CUDA graphs off: %s", layout.describe())
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(
            self.pool,
            P,
            self.fingerprint,
            kv_connector,
            lambda: self.runner.kv_pool,
            save_to_store=config.save_to_store,
            layout=layout,
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.speculator = self._speculator(config)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._compiling: list[Sequence] = []  # waiting for their structured-output grammar
        # Which C++ CPU kernel build runs ("avx2", "avx512"), "" when none does (GPU, torch).
        self.kernel_isa = (loaded_isa() or "") if loaded.device.type == "cpu" else ""
        logger.info(
            "engine ready: model %s, %d blocks of %d tokens (%s KV, %s), max_model_len %d, "
            "CPU kernels %s, %s attention",
            self.model_name,
            num_blocks,
            P,
            _dtype_name(kv_dtype),
            layout.describe(),
            self.max_model_len,
            self.kernel_isa or "none",
            attention,
        )

    def _loras(self, config: EngineConfig, model: Any) -> LoraSet:
        """The LoRA adapters of `config.lora_modules`, loaded (ConfigError when one fails)."""

        def in_use() -> list[Any]:  # the adapters of live requests (a C-level copy: no race)
            seqs = getattr(self, "_seqs", {})  # (none while the engine is being built)
            return [s.lora for s in list(seqs.values()) if s.lora is not None]

        try:
            loras = LoraSet(model, config.max_loras, config.max_lora_rank, in_use)
            modules = parse_modules(config.lora_modules)
            if len(modules) > config.max_loras:
                raise LoraError(
                    f"{len(modules)} LoRA modules given, max_loras is {config.max_loras}"
                )
            for name, path in modules.items():
                loras.load(name, path)
        except LoraError as exc:
            raise ConfigError(str(exc)) from None
        return loras

    def populate_kv_pool(self) -> None:
        """Fault in the KV pool's pages on a thread (an engine made with `populate_kv` False)."""
        from kvrelay.workers.model.llama import populate_kv_pool

        populate_kv_pool(self.runner.kv_pool)

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        try:
            self.speculation = mode = resolve_speculation(config.speculation, config.draft_model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if mode is Speculation.OFF:
            return None
        if mode is Speculation.DRAFT:
            from kvrelay.workers.engine.draft_model import DraftModelDrafter

            assert config.draft_model  # resolve_speculation: draft needs a draft model
            drafter: Drafter = DraftModelDrafter(self, config.draft_model)
        else:
            drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        device, quantization = self.loaded.device.type, self.loaded.quantization
        cost = StepCost(
            row_cost=config.spec_row_cost or default_row_cost(device, quantization),
            free_rows=default_free_rows(device, quantization),
            # On a GPU the step's fixed cost is not its bytes read: context is left out there.
            fixed_bytes=fixed_step_bytes(
                self.loaded.config, quantization, self.loaded.dtype.itemsize
            )
            if device == "cpu"
            else math.inf,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        return Speculator(drafter, config.num_speculative_tokens, cost, self.max_model_len)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def set_kv_connector(
        self, connector: KVConnector | None, load_connectors: list[KVConnector] | None = None
    ) -> None:
        """Attach (or detach) the store after construction, e.g. once the page spec, which
        needs the built KV pool, is known. Call before the first request. `load_connectors`
        (default: `connector`) serve lookups and loads, one loader thread each; give them
        store sockets of their own so a slow fetch never queues the compute loop's saves (or,
        with several, other requests' fetches) behind it."""
        self.kv.set_connector(connector, load_connectors, self.config.save_to_store)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        *,
        output_token_ids: Seq[int] = (),
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
        """Queue a request; raises InvalidRequestError for input no engine could serve.

        `retention`: the session whose pages the store keeps once the request is done here.
        `priority`: lower first (admission, and the last to be preempted); `tenant` and its
        `weight`: sequence slots are shared between tenants by weight (engine/scheduler.py).
        `lora`: the loaded LoRA adapter that serves it ("": the base model).
        `output_token_ids` resumes a request whose first outputs were produced elsewhere;
        `emitted_text_len` is how many characters of their text the client has already been
        sent (default: all that those tokens decode to, as after a hand-off).
        `sampling_checked`: the caller validated `sampling` (a decoded wire task), so only the
        vocabulary bound, unknown before, is checked here."""
        sampling = sampling if sampling is not None else SamplingParams()
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        try:
            adapter = self.loras.get(lora) if lora else None
        except LoraError as exc:
            raise InvalidRequestError(str(exc), param="model") from None
        prompt = self._check_ids(prompt_token_ids, "prompt")
        outputs = self._check_ids(output_token_ids, "output_token_ids", allow_empty=True)
        try:
            if sampling_checked:
                sampling.check_vocab(self.vocab_size)
            else:
                sampling.validate(self.vocab_size)
        except InvalidSamplingParams as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from exc
        max_tokens = sampling.max_tokens
        # at least one token past those already given must fit (the edge checks the same)
        completion = max(len(outputs) + 1, max_tokens or 0)
        message = context_overflow(self.max_model_len, len(prompt), completion)
        if message is not None:
            fits = len(prompt) + len(outputs) < self.max_model_len
            raise InvalidRequestError(message, param="max_tokens" if fits else "prompt")
        if max_tokens is not None and len(outputs) >= max_tokens:
            raise InvalidRequestError(
                f"{len(outputs)} output tokens already given, max_tokens is {max_tokens}",
                param="output_token_ids",
            )
        if handoff_after is not None and handoff_after < 1:
            raise InvalidRequestError("handoff_after must be >= 1", param="handoff_after")
        final_len = len(prompt) + (max_tokens if max_tokens is not None else self.max_model_len)
        need = self.kv.max_blocks(
            min(final_len, self.max_model_len), self.config.max_num_batched_tokens
        )
        if need > self.pool.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {need} KV blocks but the engine has {self.pool.num_blocks}",
                param="max_tokens",
            )
        seq = Sequence(
            request_id=request_id,
            token_ids=prompt + outputs,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            seed=effective_seed(sampling, request_id),
            cache_salt=cache_salt,
            retention=retention,
            priority=priority,
            tenant=tenant,
            weight=weight,
            handoff_after=handoff_after,
            lora=adapter,
            num_resumed_tokens=len(outputs),
        )
        if sampling.prompt_logprobs is not None and not outputs:  # resumed: emitted before
            seq.prompt_logprobs = [
                {"token_id": prompt[0], "logprob": None, "rank": None, "top": []}
            ]
        self.outputs.start(seq, emitted_text_len)
        if sampling.structured is not None:
            seq.grammar = self.grammars.start(sampling.structured, outputs)
            self._compiling.append(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        logger.debug(
            "request %s queued: %d prompt tokens, %d resumed outputs",
            request_id,
            len(prompt),
            len(outputs),
        )

    def _check_ids(self, ids: Seq[int], what: str, allow_empty: bool = False) -> list[int]:
        found, bad = bad_token_id(ids, self.vocab_size)
        if found:
            raise InvalidRequestError(token_id_message(bad, self.vocab_size), param=what)
        out = [operator.index(t) for t in ids]
        if not out and not allow_empty:
            raise InvalidRequestError(f"{what} is empty; give at least one token", param=what)
        return out

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.CANCELLED
    ) -> RequestOutput | None:
        """Drop a request; returns its final output, or None if it is unknown or done."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._retire(seq, time.time())
        seq.finish_reason = reason
        return self._output(seq, [], None, self.outputs.finish_text(seq))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._seqs)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns the new tokens of every request that got one."""
        failed = self._settle_grammars() if self._compiling else []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.kv.has_pending_fetches():  # nothing to compute until a store fetch lands
                self.kv.wait_fetches(0.01)
            elif self._compiling:  # nor until a grammar is compiled
                futures = [seq.grammar.future for seq in self._compiling]
                cf.wait(futures, timeout=0.01, return_when=cf.FIRST_COMPLETED)
            return failed
        logits = self.runner.run(sched.scheduled)
        self.stats.num_steps += 1
        for prompt_rows, prompt_logits in logits.prompt:
            seq = prompt_rows.seq
            targets = seq.token_ids[prompt_rows.first : prompt_rows.first + prompt_rows.num_rows]
            n = seq.sampling.prompt_logprobs or 0
            assert seq.prompt_logprobs is not None  # it has prompt rows: wants_prompt_logprobs
            seq.prompt_logprobs.extend(prompt_logprobs(prompt_logits, targets, n))
        sampling = [s for s in sched.scheduled if s.samples]
        for s in sched.scheduled:
            seq = s.seq
            computed = s.num_new_tokens - len(s.draft)  # the draft's K/V counts once accepted
            prompt_left = max(0, seq.num_tokens - 1 - seq.num_computed_tokens)
            self.stats.num_prompt_tokens_computed += min(prompt_left, computed)
            self.stats.num_computed_tokens += s.num_new_tokens
            seq.num_computed_tokens += computed
            self.kv.commit(seq)
        # Each sampling sequence's first row is what plain decoding samples: all in one call.
        first_rows, row = [], 0
        for s in sampling:
            first_rows.append(row)
            row += 1 + len(s.draft)
        first = logits.sample if row == len(sampling) else logits.sample[first_rows]
        rows = [self._sample_row(s.seq) for s in sampling]
        results = self.sampler(first, rows) if rows else []
        now = time.time()
        outs = failed
        for s, start, res in zip(sampling, first_rows, results, strict=True):
            seq = s.seq
            tokens, lps = [res.token_id], [res.logprobs]
            text = self.outputs.append(seq, res.token_id)
            if s.draft:
                text += self._verify(s, logits.sample, start, tokens, lps)
            if seq.finish_reason is FinishReason.ERROR:  # its grammar failed on the last token
                self._grammar_failed(seq, tokens, lps)
            self.stats.num_generated_tokens += len(tokens)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if seq.finish_reason is not None or seq.handoff:
                self._retire(seq, now)
            # A request's rows all have logprobs or none do.
            new_lps = cast("list[dict[int, float]]", lps) if lps and lps[0] is not None else None
            out = self._output(seq, tokens, new_lps, text)
            if tokens and seq.num_new_outputs == len(tokens):  # the first carries the prompt's
                out.prompt_logprobs = seq.prompt_logprobs
            if seq.finish_reason is FinishReason.ERROR and seq.grammar is not None:
                out.error = seq.grammar.error
            outs.append(out)
        return outs

    def _verify(
        self,
        s: ScheduledSeq,
        logits: torch.Tensor,
        start: int,
        tokens: list[int],
        lps: list[dict[int, float] | None],
    ) -> str:
        """Accept `s.draft` while each sampled token equals its draft token: row `start + j`
        of `logits` follows the first `j` draft tokens, so its sample (with the draw of its own
        output position) is plain decoding's next token once they are accepted. Appends the
        tokens after the first (already in `tokens`); returns their text."""
        seq, draft = s.seq, s.draft
        text = ""
        accepted, rejected = 0, False
        while accepted < len(draft) and seq.finish_reason is None and not seq.handoff:
            if tokens[-1] != draft[accepted]:
                rejected = True
                break
            accepted += 1
            row = logits[start + accepted : start + accepted + 1]
            res = self.sampler(row, [self._sample_row(seq)])[0]
            tokens.append(res.token_id)
            lps.append(res.logprobs)
            text += self.outputs.append(seq, res.token_id)
        # draft tokens left unchecked because the request ended are not counted as drafted
        checked = accepted + rejected if rejected or accepted < len(draft) else len(draft)
        seq.spec.record(checked, accepted, rejected)
        self.stats.num_draft_tokens += checked
        self.stats.num_accepted_tokens += accepted
        self.stats.num_verifications += 1
        seq.num_computed_tokens += accepted  # K/V of the accepted draft tokens is valid
        self.kv.commit(seq)
        return text

    def _retire(self, seq: Sequence, now: float) -> None:
        """`seq` is done here (finished, handed off, failed, aborted): free what it holds."""
        self._seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finished_time = now

    def _settle_grammars(self) -> list[RequestOutput]:
        """Give compiled grammars to their sequences; finish those whose grammar failed (an
        `error` output: a task no engine can serve, or outputs that do not fit it)."""
        outs, waiting = [], []
        for seq in self._compiling:
            if seq.is_finished:  # aborted while compiling
                continue
            if not seq.grammar.poll():
                waiting.append(seq)
            elif seq.grammar.error is not None:
                logger.warning("request %s: %s", seq.request_id, seq.grammar.error)
                self._retire(seq, time.time())
                seq.finish_reason = FinishReason.ERROR
                out = self._output(seq, [], None, "")
                out.error = seq.grammar.error
                outs.append(out)
        self._compiling = waiting
        return outs

    def _grammar_failed(
        self, seq: Sequence, tokens: list[int], lps: list[dict[int, float] | None]
    ) -> None:
        """`seq`'s grammar matcher failed on the last sampled token (a limit of the grammar
        engine reached mid-answer): that token is no output (OutputProcessor.append left it
        out), and the request ends with "error", never "stop" with text that breaks it."""
        tokens.pop()
        lps.pop()
        assert seq.grammar is not None
        logger.warning("request %s: %s", seq.request_id, seq.grammar.error)

    def _sample_row(self, seq: Sequence) -> SampleRow:
        p = seq.sampling
        row = SampleRow(
            p, seq.seed, seq.num_output_tokens, banned_token_ids=self.outputs.banned_tokens(seq)
        )
        # Token lists only when a penalty reads them (copying a long prompt every step costs).
        if p.repetition_penalty != 1.0:
            row.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            row.output_token_ids = seq.token_ids[seq.num_prompt_tokens :]
        if seq.grammar is not None:
            row.allowed_token_mask = seq.grammar.allowed()
        return row

    def _output(
        self, seq: Sequence, new: list[int], lps: list[dict] | None, text: str
    ) -> RequestOutput:
        finished = seq.finish_reason is not None
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.num_output_tokens - len(new),
            new_token_ids=new,
            new_logprobs=lps,
            text_delta=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            handoff=seq.handoff,
            output_token_ids=seq.output_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=self._metrics(seq) if finished or seq.handoff else {},
        )

    @staticmethod
    def _metrics(seq: Sequence) -> dict[str, Any]:
        return {
            "arrival_time": seq.arrival_time,
            "first_scheduled_time": seq.first_scheduled_time,
            "first_token_time": seq.first_token_time,
            "last_token_time": seq.last_token_time,
            "finished_time": seq.finished_time,
            "num_preemptions": seq.num_preemptions,
            "num_device_cached_tokens": seq.num_device_cached_tokens,
            "num_store_cached_tokens": seq.num_store_cached_tokens,
            "num_draft_tokens": seq.spec.num_draft_tokens,
            "num_accepted_tokens": seq.spec.num_accepted_tokens,
            "num_verifications": seq.spec.num_verifications,
        }

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion as one batch; one merged RequestOutput per prompt."""
        if self.has_unfinished_requests():
            # generate() consumes every step's outputs; other requests' tokens would be lost.
            raise EngineError("generate() needs an idle engine (requests are still running)")
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = request_ids or [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                prev = merged.get(out.request_id)
                merged[out.request_id] = out if prev is None else merge_outputs(prev, out)
        return [merged[rid] for rid in ids]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
