"""Prompt token counts and prefix blocks: exact with a model's tokenizer, a byte-based bound without one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.errors import ConfigError

__all__ = ["PromptInfo", "TokenCounter", "chain_hashes", "verified_tokenizer"]

# Tokens a chat template adds around each message (role markers, separators); vLLM's templates for
# Llama/Qwen add 4-5, so counting 4 keeps the estimate a lower bound.
_PER_MESSAGE = 4


@dataclass(slots=True)
class PromptInfo:
    tokens: int
    """Prompt tokens: exact with a tokenizer, else a lower bound (bytes ÷ max_bytes_per_token)."""
    exact: bool
    blocks: list[int]
    """Chained hashes of the prompt's leading fixed-size blocks (prefix affinity)."""


def chain_hashes(data: bytes | list[int], block: int, max_blocks: int) -> list[int]:
    """Hash ``data`` in ``block``-sized pieces, each hash covering everything before it.

    Only whole blocks count: a partial tail is not a reusable prefix in a paged KV cache either.
    """
    out: list[int] = []
    h = 0
    n = min(len(data) // block, max_blocks)
    for i in range(n):
        piece = data[i * block : (i + 1) * block]
        h = hash((h, piece if isinstance(piece, bytes) else tuple(piece)))
        out.append(h)
    return out


def verified_tokenizer(weights_dir: Path) -> tuple[Path, dict[str, Any]]:
    """``tokenizer.json`` of a verified weights directory and its ``tokenizer_config.json`` (chat template,
    special tokens), each checked against the directory's ``SHA256SUMS``; ConfigError when either is
    missing from the manifest or differs from it."""
    import json

    from controlplane.errors import WeightsError
    from controlplane.weights import read_manifest, sha256_file

    try:
        entries = read_manifest(weights_dir)
    except WeightsError as exc:
        raise ConfigError(f"tokenizer of {weights_dir}: {exc.message}") from None
    config: dict[str, Any] = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = weights_dir / name
        if name not in entries:
            if name == "tokenizer.json":
                raise ConfigError(f"{weights_dir} has no tokenizer.json in its manifest")
            continue
        if not path.is_file() or sha256_file(path) != entries[name]:
            raise ConfigError(f"{path} does not match its manifest")
        if name == "tokenizer_config.json":
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{path}: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
    return weights_dir / "tokenizer.json", config


def _special(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):  # AddedToken form: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


class TokenCounter:
    """Counts one model's prompt tokens; thread-safe (the Rust tokenizer releases the GIL).

    With the model's chat template (``tokenizer_config.json``), a chat's count is the template rendered
    over its messages with the generation prompt, as vLLM renders it, encoded without extra special tokens:
    exact except for tools, which vLLM also renders into the prompt and this count leaves out (so it stays
    a lower bound with tools).
    """

    def __init__(
        self,
        *,
        tokenizer_path: Path | None,
        max_bytes_per_token: int,
        block_tokens: int,
        block_bytes: int,
        max_blocks: int,
        tokenizer_config: dict[str, Any] | None = None,
    ) -> None:
        self._tok: Any = None
        if tokenizer_path is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:  # pragma: no cover - tokenizers is a core dependency
                raise ConfigError(
                    "counting tokens needs the 'tokenizers' package (pip install tokenizers)"
                ) from exc
            try:
                self._tok = Tokenizer.from_file(str(tokenizer_path))
            except Exception as exc:  # the Rust binding raises a bare Exception on unreadable files
                raise ConfigError(f"cannot load tokenizer {tokenizer_path}: {exc}") from None
        self._template: Any = None
        self._specials: dict[str, str] = {}
        template = (tokenizer_config or {}).get("chat_template")
        if self._tok is not None and isinstance(template, str):
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                self._template = env.from_string(template)
            except TemplateError:
                self._template = None  # a template jinja cannot compile: count messages without it
            cfg = tokenizer_config or {}
            self._specials = {
                k: _special(cfg, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            }
        self._bpt = max_bytes_per_token
        self._block_tokens = block_tokens
        self._block_bytes = block_bytes
        self._max_blocks = max_blocks

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def _render(self, texts: list[str], roles: list[str]) -> str | None:
        from jinja2 import TemplateError

        try:
            return str(
                self._template.render(
                    messages=[{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)],
                    add_generation_prompt=True,
                    **self._specials,
                )
            )
        except (TemplateError, TypeError, ValueError):
            return None  # e.g. a template that raises on an unsupported role order

    def measure(
        self,
        texts: list[str],
        token_ids: list[list[int]],
        messages: int = 0,
        roles: list[str] | None = None,
    ) -> PromptInfo:
        """Count ``texts`` (and pre-tokenised ``token_ids``) and cut the prefix blocks of the first prompt;
        ``roles``: the chat messages' roles, for the chat template."""
        if self._template is not None and roles is not None and len(roles) == len(texts) == messages:
            rendered = self._render(texts, roles)
            if rendered is not None:
                ids = self._tok.encode(rendered, add_special_tokens=False).ids
                blocks = chain_hashes(ids, self._block_tokens, self._max_blocks)
                return PromptInfo(tokens=len(ids), exact=True, blocks=blocks)
        ids_total = sum(len(ids) for ids in token_ids)
        first_ids: list[int] | None = token_ids[0] if token_ids else None
        if self._tok is not None and texts:
            encs = self._tok.encode_batch(texts, add_special_tokens=True)
            tokens = sum(len(e.ids) for e in encs) + ids_total + _PER_MESSAGE * messages
            if first_ids is None:
                # A chat's prefix is all its messages in order (the shared system prompt comes first).
                limit = self._block_tokens * self._max_blocks
                first_ids = []
                for e in encs if messages else encs[:1]:
                    first_ids.extend(e.ids[: limit - len(first_ids)])
                    if len(first_ids) >= limit:
                        break
            blocks = chain_hashes(first_ids, self._block_tokens, self._max_blocks)
            return PromptInfo(tokens=tokens, exact=True, blocks=blocks)
        if first_ids is not None and not texts:
            blocks = chain_hashes(first_ids, self._block_tokens, self._max_blocks)
            return PromptInfo(tokens=ids_total, exact=True, blocks=blocks)
        raw = [t.encode("utf-8", "surrogatepass") for t in texts]
        nbytes = sum(len(r) for r in raw)
        tokens = -(-nbytes // self._bpt) + ids_total + (_PER_MESSAGE * messages if messages else 0)
        joined = b"\x00".join(raw) if len(raw) > 1 and messages else (raw[0] if raw else b"")
        blocks = chain_hashes(
            joined[: self._block_bytes * self._max_blocks], self._block_bytes, self._max_blocks
        )
        return PromptInfo(tokens=tokens, exact=False, blocks=blocks)
