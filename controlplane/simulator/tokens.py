"""The simulator's deterministic tokenizer, chat template and output text.

Tokenizer: a token is up to four non-space characters together with the whitespace before them
(regex ``\\s*\\S{1,4}``), plus any trailing whitespace as one last token. English text comes out near
real BPE counts (about four characters per token) without any vocabulary, and every output piece the
simulator generates is exactly one token, so ``count_tokens(output) == usage.completion_tokens``.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

__all__ = [
    "count_tokens",
    "generate_pieces",
    "piece_of",
    "render_chat",
    "text_seed",
    "token_ids",
    "tokenize",
]

_TOKEN_RE = re.compile(r"\s*\S{1,4}|\s+")

# Words of at most four letters: each " word" piece is one token under the rule above.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "as", "with", "his",
    "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not", "but", "what", "all",
    "were", "when", "we", "can", "an", "your", "said", "if", "do", "will", "each", "how", "up", "out",
    "them", "then", "she", "many", "some", "so", "make", "like", "him", "into", "time", "has", "look",
    "two", "more", "go", "see", "no", "way",
)  # fmt: skip
_PIECES = tuple(" " + w for w in _WORDS)


def tokenize(text: str) -> list[str]:
    """Split ``text`` into tokens (see the module docstring)."""
    return _TOKEN_RE.findall(text)


def count_tokens(text: str) -> int:
    return len(_TOKEN_RE.findall(text))


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt a chat request becomes: one ``<|role|>`` header per message, then the assistant's."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def text_seed(seed: int, text: str) -> int:
    """A seed stable across processes (``hash()`` of a str is randomised per process)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"), seed & 0xFFFFFFFF)


def generate_pieces(seed: int, count: int) -> list[str]:
    """``count`` output tokens, the same for the same seed."""
    return random.Random(seed).choices(_PIECES, k=count)  # noqa: S311 - not for security


def token_ids(text: str) -> list[int]:
    """Stable ids of ``text``'s tokens (``/tokenize``): a checksum of each token, within a 32k vocabulary."""
    return [zlib.crc32(t.encode("utf-8", "surrogatepass")) % 32000 for t in tokenize(text)]


def piece_of(token_id: int) -> str:
    """The output piece an id stands for (``/detokenize``)."""
    return _PIECES[token_id % len(_PIECES)]
