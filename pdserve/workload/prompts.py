"""Prompt text of an exact length in tokens."""

from __future__ import annotations

import numpy as np

from pdserve.workload.errors import BenchError
from pdserve.workload.tokenizer import TokenizerLike
from pdserve.workload.words import COMMON_WORDS

# Enough distinct words that random text does not collapse into a handful of repeats.
_MIN_WORDS = 32
# Each fix-up round moves the length toward the target by the measured error; byte-level BPE
# converges in one or two rounds, other tokenizers in a few more.
_MAX_ROUNDS = 16


class PromptSynthesizer:
    """Builds random word text that encodes to exactly a requested number of tokens.

    Text is a fixed lead-in followed by space-separated words drawn from those the tokenizer
    keeps as one token each (with their leading space), so the token count moves one for one
    with the word count; the encoded length is then measured and corrected until exact.
    """

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self.words = [w for w in COMMON_WORDS if _is_single_token(tokenizer, " " + w)]
        if len(self.words) < _MIN_WORDS:
            raise BenchError(
                f"the tokenizer keeps only {len(self.words)} common English words as single "
                f"tokens (need {_MIN_WORDS}); it cannot build exact-length prompts"
            )

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def text(self, num_tokens: int, rng: np.random.Generator, lead: str = "") -> str:
        """Return `lead` plus random words, `num_tokens` tokens long in all.

        Raises BenchError when `lead` alone takes `num_tokens` or more.
        """
        if num_tokens < 1:
            raise BenchError(f"a prompt needs at least 1 token, asked for {num_tokens}")
        num_lead = self.num_tokens(lead) if lead else 0
        if num_lead >= num_tokens:
            raise BenchError(
                f"prompt lead-in {lead!r} is {num_lead} tokens, leaving no room in {num_tokens}"
            )
        words = self._draw(num_tokens - num_lead, rng)
        for _ in range(_MAX_ROUNDS):
            text = lead + "".join(" " + w for w in words)
            error = self.num_tokens(text) - num_tokens
            if error == 0:
                return text
            if error < 0:
                words.extend(self._draw(-error, rng))
            elif error >= len(words):
                words = words[:1]
            else:
                del words[len(words) - error :]
        raise BenchError(f"could not build a prompt of exactly {num_tokens} tokens")

    def _draw(self, count: int, rng: np.random.Generator) -> list[str]:
        return [self.words[i] for i in rng.integers(len(self.words), size=count)]


def _is_single_token(tokenizer: TokenizerLike, text: str) -> bool:
    return len(tokenizer.encode(text)) == 1
