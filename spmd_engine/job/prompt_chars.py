"""A bound on a text prompt's characters, checked before it is tokenized.

Why: a prompt is rejected as too long only once its tokens are counted, and a 5 MB line cost a
tokenization of a million tokens (and transformers' warning about it) to learn that. No text can
need fewer tokens than its characters divided by the most characters one token stands for: the
longest string in the tokenizer's vocabulary (a byte-level BPE symbol is one byte, so a symbol
count is at least the characters it decodes to; added tokens count by their text). A fixed ratio
would not do: SmolLM2 has a token of 81 characters (a newline and 80 spaces). NORMALIZATION_SLACK
covers a normalizer that composes several code points into one (NFC: at most 4 into 1). A prompt
over the bound could never fit, so rejecting it untokenized never rejects one that would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NORMALIZATION_SLACK = 4  # code points a normalizer may compose into one character (NFC's longest: 4)


@dataclass(frozen=True)
class PromptCharLimit:
    """The most characters a prompt of fewer than `max_model_len` tokens can have with one tokenizer."""

    max_model_len: int
    chars_per_token: int  # the longest vocabulary entry, in characters (symbols)

    @property
    def max_chars(self) -> int:
        return NORMALIZATION_SLACK * self.chars_per_token * self.max_model_len

    def problem(self, text: str) -> str | None:
        """Why `text` can't fit, untokenized (one line), or None when it may."""
        if len(text) <= self.max_chars:
            return None
        return (f"prompt has {len(text):,} characters; max_model_len={self.max_model_len} tokens hold at most "
                f"{self.max_chars:,} with this tokenizer (not tokenized)")


def prompt_char_limit(tokenizer: Any, max_model_len: int | None) -> PromptCharLimit | None:
    """The bound for `tokenizer`, or None (no tokenizer, no length, or a vocabulary it can't list)."""
    if tokenizer is None or max_model_len is None:
        return None
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a listable vocabulary: no bound, prompts are tokenized
        return None
    return PromptCharLimit(max_model_len, longest) if longest > 0 else None
