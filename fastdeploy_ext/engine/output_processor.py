"""After each step, on the host: append the sampled token, detokenize incrementally, check the
stop conditions (eos, stop ids, stop strings, max_tokens, the repetition-loop guard; max_tokens
is resolved within max_model_len at admission, so it bounds the context too) and build the
RequestOutput (outputs.py: deltas, O(new tokens) per output).

Stop strings in streams: while a stop string could still be completing, the last
max(len(stop)) - 1 characters are held back from delta_text (vLLM's rule), so nothing a stop
string later cuts off is ever streamed; the deltas join to exactly the final text. Of several
stop strings the one that starts earliest in the text wins, whatever the list order."""
from __future__ import annotations

from .outputs import RequestOutput
from .sequence import FinishReason, Sequence

# vLLM's incremental detokenization: decode a small window of ids before the new ones and keep
# only the new characters; an unfinished UTF-8 sequence ("\ufffd") waits for the next token.
_REPLACEMENT = "\ufffd"


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ detokenization
    def _detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
        if full.endswith(_REPLACEMENT) or len(full) < len(prefix):
            return ""
        new = full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += new
        return new

    # ------------------------------------------------------------------ stops
    @staticmethod
    def _repetition(seq: Sequence, token: int) -> bool:
        """runs[p-1] counts the trailing output positions i with out[i] == out[i - p]; a run of r
        means the last r + p tokens have period p. List comprehensions, not a per-period loop:
        this runs for every token of every sequence on the step loop (~8 us at max_period 64)."""
        g = seq.params.repetition_guard
        if not g.enabled:
            return False
        n = seq.num_tokens - 1                               # index of the new token
        ids = seq.token_ids
        tail = ids[max(seq.prompt_len, n - g.max_period):n][::-1]   # tail[p-1] = ids[n-p], output only
        runs = seq.repeat_runs
        if token not in tail:            # no period repeats: every run ends (decided in C)
            if any(runs):
                seq.repeat_runs = [0] * len(runs)
            return False
        runs[:len(tail)] = [r + 1 if t == token else 0 for r, t in zip(runs, tail)]
        runs[len(tail):] = [0] * (len(runs) - len(tail))
        if seq.repeat_thresholds is None:
            seq.repeat_thresholds = [g.span_needed(p) - p for p in range(1, g.max_period + 1)]
        th = seq.repeat_thresholds
        if max(runs) < min(th):          # the usual case, decided in C
            return False
        return any(r >= t for r, t in zip(runs, th))

    def _check_stop(self, seq: Sequence, token: int, new_text: str) -> None:
        p = seq.params
        out_len = seq.num_output_tokens
        if out_len >= p.min_tokens:
            if not p.ignore_eos and token in seq.eos_token_ids:
                seq.finish_reason = FinishReason.STOP
                return
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
                return
            if p.stop and new_text:
                # only the new text and the tail that a stop string could straddle
                window = max(len(s) for s in p.stop) + len(new_text)
                tail_start = max(len(seq.text) - window, 0)
                hits = [(seq.text.find(s, tail_start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    seq.text = seq.text[:i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, s
                    return
        if self._repetition(seq, token):
            seq.finish_reason, seq.stop_reason = FinishReason.REPETITION, "repetition"
            return
        if out_len >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH

    # ------------------------------------------------------------------ per token
    def append_token(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> str:
        """Append one sampled token; returns the new text. Sets seq.finish_reason when it ends."""
        seq.token_ids.append(token)
        if seq.metrics.first_token is None:
            seq.metrics.first_token = now
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob["logprob"]
        # incremental text only where someone reads it before the end (streams, stop strings);
        # otherwise the output is decoded once when it finishes (two tokenizer calls per token
        # and sequence would cost the step loop ~2 ms per step at batch 64)
        incremental = seq.stream or bool(seq.params.stop)
        new_text = self._detokenize(seq) if incremental else ""
        self._check_stop(seq, token, new_text)
        if seq.finish_reason is not None and not (seq.finish_reason == FinishReason.STOP and isinstance(seq.stop_reason, str)):
            new_text += self.flush(seq)
        return new_text

    def flush(self, seq: Sequence) -> str:
        """The request ended: decode whatever a pending UTF-8 sequence held back (everything,
        for a request that was not detokenized incrementally)."""
        if self.tokenizer is None or not seq.params.detokenize or seq.read_offset >= seq.num_tokens:
            return ""
        skip = seq.params.skip_special_tokens
        prefix = self.tokenizer.decode(seq.token_ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(seq.token_ids[seq.prefix_offset:], skip_special_tokens=skip)
        new = full[len(prefix):]
        seq.prefix_offset = seq.read_offset = seq.num_tokens
        seq.text += new
        return new

    @staticmethod
    def stop_holdback(seq: Sequence) -> int:
        """Characters of a running request's text not streamed yet: a stop string may still be
        completing in them (none when the stop string is kept in the output anyway)."""
        p = seq.params
        if not p.stop or p.include_stop_str_in_output:
            return 0
        return max(len(s) for s in p.stop) - 1

    def make_output(self, seq: Sequence, num_sent_tokens: int, error: str | None = None) -> RequestOutput:
        """What is new since the previous output (num_sent_tokens ids were sent): O(new tokens);
        the final output also carries the whole generation."""
        finished = seq.finish_reason is not None
        end = len(seq.text) if finished else len(seq.text) - self.stop_holdback(seq)
        start = seq.num_sent_text
        delta = seq.text[start:end] if end > start else ""
        seq.num_sent_text = max(start, end)
        want_lp = seq.params.logprobs is not None
        out = RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt.prompt_text, prompt_token_ids=seq.prompt.prompt_token_ids,
            delta_token_ids=seq.token_ids[seq.prompt_len + num_sent_tokens:], delta_text=delta,
            delta_logprobs=seq.logprobs[num_sent_tokens:] if want_lp else None,
            num_output_tokens=seq.num_output_tokens,
            finish_reason=seq.finish_reason.value if finished else None, stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob if want_lp else None, error=error, metrics=seq.metrics)
        if finished:     # the whole generation, once (the sequence is done: its lists are handed over)
            out.token_ids, out.text = seq.output_token_ids, seq.text
            out.logprobs = seq.logprobs if want_lp else None
        return out
