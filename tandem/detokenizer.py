"""IncrementalDetokenizer: token ids -> stable text deltas, with stop strings matched across chunks."""

from __future__ import annotations

from typing import Any

from tandem.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token so that its leading space (sentencepiece
# "▁", byte-level "Ġ") renders as it would in the middle of the text.
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they arrive.

    Text is produced by decoding a small window of tokens, ``ids[prefix_offset:]``, and taking what
    it adds over ``ids[prefix_offset:read_offset]``; a window whose text ends in U+FFFD is an
    unfinished multi-byte character and is held until a later token completes it. Stable text then
    passes the stop-string check, which holds back the longest suffix that could begin a stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: do not let outputs complete it
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._held = ""  # stable text not yet returned because it could be the start of a stop string
        self._emitted: list[str] = []
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.num_output_tokens = 0  # tokens consumed; tokens after a matched stop string are ignored

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """The output text so far, held-back characters included (cut at the stop string)."""
        return "".join(self._emitted) + self._held

    def update(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Consumes tokens; returns (newly final text, the stop string that matched or None)."""
        out: list[str] = []
        for token_id in new_token_ids:
            if self.finished:
                break
            self.num_output_tokens += 1
            self._ids.append(token_id)
            delta = self._decode_step(final=False)
            if delta:
                out.append(self._check_stop(delta))
        return "".join(out), self.stop_reason

    def flush(self) -> str:
        """Returns the text still held back (unfinished characters, stop-string prefixes) at finish."""
        if self.finished:
            return ""
        delta = self._decode_step(final=True)
        text = self._check_stop(delta) if delta else ""
        if not self.finished:
            text += self._held
            self._emitted.append(self._held)
            self._held = ""
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self, final: bool) -> str:
        """Returns the window's new stable text and slides the window; '' while a char is unfinished."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        if not final and window_text.endswith(REPLACEMENT_CHAR):
            return ""
        if window_text.startswith(prefix_text):
            delta = window_text[len(prefix_text):]
        else:  # a decoder that rewrites earlier text (e.g. space clean-up): trust the common prefix
            common = _common_prefix_len(prefix_text, window_text)
            delta = window_text[common:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep only the window: ids before prefix_offset never change the text again.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _check_stop(self, delta: str) -> str:
        """Runs held + delta through the stop strings; returns what is now final."""
        buffer = self._held + delta
        if not self.stop:
            self._held = ""
            self._emitted.append(buffer)
            return buffer
        match = _earliest_stop(buffer, self.stop)
        if match is not None:
            index, stop = match
            end = index + len(stop) if self.include_stop_str_in_output else index
            final = buffer[:end]
            self.stop_reason = stop
            self._held = ""
        else:
            hold = _stop_prefix_suffix_len(buffer, self.stop)
            final, self._held = buffer[:len(buffer) - hold], buffer[len(buffer) - hold:]
        self._emitted.append(final)
        return final


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _stop_prefix_suffix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
