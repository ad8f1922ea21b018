"""After a token is sampled: detokenize, check stop conditions, build the text delta.

Stop checks, in order (vLLM's): eos (unless ignore_eos) and stop_token_ids once `min_tokens`
outputs exist (their text is not part of the output unless include_stop_str_in_output), then
stop strings on the detokenized text (the text is cut at the stop, or just after it with
include_stop_str_in_output), then a structured-output grammar that takes no further token
("stop", the token's text kept), then max_tokens / the context limit ("length"). A grammar
whose matcher fails on the token ends the request with "error" before any of that: the token is
not appended, so no output breaks the constraint.

While a request streams, the last `max(len(stop)) - 1` characters are held back (unless
include_stop_str_in_output) so that text which later turns out to start a stop string is
never sent; a finished or handed-off request sends everything it has.
"""

from __future__ import annotations

from kvrelay.core.enums import FinishReason
from kvrelay.core.tokenizer import IncrementalDetokenizer, Tokenizer
from kvrelay.workers.engine.sequence import Sequence


class OutputProcessor:
    """Per-engine helper owning the tokenizer and the eos ids."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, seq: Sequence, emitted_text_len: int | None = None) -> None:
        """Create the detokenizer; replay resumed outputs as already-sent text.

        The replay adds one token at a time, as the worker that produced them did, so the
        detokenizer ends in the same state: bytes of a character that the last resumed token
        left unfinished are still held back and come out with the token that completes it.
        `emitted_text_len` (characters the client already has) covers text another worker
        held back before it died, e.g. a possible stop-string prefix."""
        p = seq.sampling
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens
        )
        if seq.num_resumed_tokens:
            text = [seq.detokenizer.add((t,)) for t in seq.output_token_ids]
            seq.output_text = "".join(text)
            sent = len(seq.output_text) if emitted_text_len is None else emitted_text_len
            seq.emitted_text_len = max(0, min(sent, len(seq.output_text)))

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Stop tokens to mask while fewer than min_tokens outputs exist."""
        p = seq.sampling
        if seq.num_output_tokens >= p.min_tokens:
            return []
        banned = list(p.stop_token_ids)
        if not p.ignore_eos:
            banned.extend(self.eos_token_ids)
        return banned

    def append(self, seq: Sequence, token_id: int) -> str:
        """Add a sampled token to `seq`; set its finish state; return the text to send (a
        token its grammar's matcher fails on is not added: the request fails, "error")."""
        complete = seq.grammar is not None and seq.grammar.advance(token_id)
        if seq.grammar is not None and seq.grammar.error is not None:
            seq.finish_reason, seq.stop_reason = FinishReason.ERROR, None
            return ""
        seq.token_ids.append(token_id)
        p = seq.sampling
        n_out = seq.num_output_tokens
        stop_tok = False
        if n_out >= p.min_tokens:
            if token_id in self.eos_token_ids and not p.ignore_eos:
                seq.finish_reason, seq.stop_reason, stop_tok = FinishReason.STOP, None, True
            elif token_id in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason, stop_tok = FinishReason.STOP, token_id, True
        if not stop_tok or p.include_stop_str_in_output:
            before = len(seq.output_text)
            seq.output_text += seq.detokenizer.add([token_id])
            if p.stop and n_out >= p.min_tokens and not stop_tok:
                self._check_stop_strings(seq, before)
        if seq.finish_reason is None and complete:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, None
        at_limit = p.max_tokens is not None and n_out >= p.max_tokens
        if seq.finish_reason is None and (at_limit or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = FinishReason.LENGTH
        if (
            seq.finish_reason is None
            and seq.handoff_after is not None
            and seq.num_new_outputs >= seq.handoff_after
        ):
            seq.handoff = True
        if seq.finish_reason is not None:
            return self.finish_text(seq)
        return self._take_text(seq)

    def _check_stop_strings(self, seq: Sequence, before: int) -> None:
        p = seq.sampling
        text = seq.output_text
        best: tuple[int, str] | None = None
        for stop in p.stop:
            idx = text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return
        idx, stop = best
        end = idx + len(stop) if p.include_stop_str_in_output else idx
        seq.output_text = text[: max(end, seq.emitted_text_len)]
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop

    def _take_text(self, seq: Sequence) -> str:
        p = seq.sampling
        end = len(seq.output_text)
        done = seq.finish_reason is not None or seq.handoff
        if not done and p.stop and not p.include_stop_str_in_output:
            end -= max(len(s) for s in p.stop) - 1
        if end <= seq.emitted_text_len:
            return ""
        delta = seq.output_text[seq.emitted_text_len : end]
        seq.emitted_text_len = end
        return delta

    def finish_text(self, seq: Sequence) -> str:
        """All text not yet sent, for a request that has just finished (any reason)."""
        if not isinstance(seq.stop_reason, str) and seq.detokenizer is not None:
            # An unfinished UTF-8 character at the very end renders as U+FFFD, exactly as
            # decoding all output ids at once would.
            seq.output_text += seq.detokenizer.flush()
        return self._take_text(seq)
