"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and BPE merges that depend on context, so
each step decodes a short window ending at the newest token and emits only the text past what
the window's prefix already produced. Text that could be the start of a stop string is held
back until it is known not to be one.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context re-decoded before the new ones; enough for any merge or UTF-8 sequence.
CONTEXT_TOKENS = 6


class TextDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Per-request incremental detokenizer. `output_text` is the full text so far."""

    def __init__(self, tokenizer: TextDecoder, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens whose text is already in output_text
        self.output_text = ""
        self._num_emitted_chars = 0
        self.is_stopped = False

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tokens; updates `output_text` and `is_stopped` (a stop string was found)."""
        self._token_ids.extend(token_ids)
        prefix = self._tokenizer.decode(self._token_ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._token_ids[self._prefix_offset :])
        if full.endswith(REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return  # an incomplete character: wait for the rest of its bytes
        start = len(self.output_text)
        self.output_text += full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self._token_ids) - CONTEXT_TOKENS)
        self._read_offset = len(self._token_ids)
        self._check_stop(start)

    def take_new_text(self, is_final: bool) -> str:
        """Text not yet emitted, keeping back a possible stop-string prefix unless final."""
        end = len(self.output_text)
        if not (is_final or self.is_stopped):
            end = max(end - self._holdback, self._num_emitted_chars)
        text = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return text

    def _check_stop(self, new_text_start: int) -> None:
        for stop in self._stop:
            # A match may straddle the boundary between old and new text.
            search_from = max(new_text_start - len(stop) + 1, 0)
            index = self.output_text.find(stop, search_from)
            if index != -1:
                self.output_text = self.output_text[:index]
                self.is_stopped = True
                return
