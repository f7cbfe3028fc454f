"""Pluggable pre-request and post-response hooks; built in: deny-lists, PII redaction, a moderation model."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pydantic import BaseModel

from controlplane.gateway.config import GuardrailConfig
from controlplane.gateway.errors import ApiError
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.schemas import ChatCompletionRequest, CompletionRequest

__all__ = [
    "PII_PATTERNS",
    "DenyListHook",
    "Guardrails",
    "ModerationHook",
    "PreRequestHook",
    "SseRewriter",
    "StreamFilter",
    "TextFilter",
]

# Deliberately simple, high-precision patterns; a site adds its own through deny_output_patterns.
PII_PATTERNS: dict[str, str] = {
    "EMAIL": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,253}\.[A-Za-z]{2,24}",
    "CARD": r"\b(?:\d[ -]?){12,18}\d\b",
    "SSN": r"\b\d{3}-\d{2}-\d{4}\b",
    "PHONE": r"(?<![\w+])\+?\d{1,3}[ .-]?\(?\d{2,4}\)?[ .-]?\d{3,4}[ .-]?\d{3,4}\b",
}
# Text held back from a stream so that a match split across chunks is still found: longer matches than
# this can escape redaction in a stream (never in a non-streamed answer).
_HOLDBACK = 128


class PreRequestHook(Protocol):
    """Sees the request's texts before any replica does; raises :class:`ApiError` to refuse it."""

    name: str

    async def __call__(self, model: str, texts: list[str]) -> None: ...


class TextFilter:
    """Regex substitutions applied to text: PII placeholders and masked deny-list matches."""

    def __init__(self, rules: list[tuple[re.Pattern[str], str]]) -> None:
        self._rules = rules

    def apply(self, text: str) -> str:
        for pattern, repl in self._rules:
            text = pattern.sub(repl, text)
        return text

    def stream(self) -> StreamFilter:
        return StreamFilter(self)


class StreamFilter:
    """One choice's streamed text: filters over a sliding buffer so matches split across chunks are caught."""

    def __init__(self, text_filter: TextFilter) -> None:
        self._f = text_filter
        self._buf = ""

    def feed(self, text: str) -> str:
        out = self._f.apply(self._buf + text)
        if len(out) <= _HOLDBACK:
            self._buf = out
            return ""
        self._buf = out[-_HOLDBACK:]
        return out[:-_HOLDBACK]

    def flush(self) -> str:
        out, self._buf = self._f.apply(self._buf), ""
        return out


def _texts_of(choice: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    if isinstance(choice.get("text"), str):
        return choice, "text"
    for holder in (choice.get("delta"), choice.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("content"), str):
            return holder, "content"
    return None


class SseRewriter:
    """Rewrites an OpenAI SSE stream's choice texts through per-choice :class:`StreamFilter`s."""

    def __init__(self, text_filter: TextFilter) -> None:
        self._f = text_filter
        self._streams: dict[int, StreamFilter] = {}
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def close(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            found = _texts_of(choice)
            idx = choice.get("index", 0)
            stream = self._streams.setdefault(idx if isinstance(idx, int) else 0, self._f.stream())
            text = stream.feed(found[0][found[1]]) if found else ""
            if choice.get("finish_reason") is not None:
                text += stream.flush()
            if found:
                found[0][found[1]] = text
            elif text:
                choice.setdefault("delta", {})["content"] = text
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode()

    def rewrite_body(self, body: bytes) -> bytes:
        """A non-streamed answer: filter each choice's whole text."""
        try:
            obj = json.loads(body)
        except ValueError:
            return body
        for choice in obj.get("choices") or [] if isinstance(obj, dict) else []:
            found = _texts_of(choice) if isinstance(choice, dict) else None
            if found:
                found[0][found[1]] = self._f.apply(found[0][found[1]])
        return json.dumps(obj).encode()


class DenyListHook:
    """Refuses prompts matching any configured regular expression."""

    name = "deny_list"

    def __init__(self, patterns: list[str]) -> None:
        self._re = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    async def __call__(self, model: str, texts: list[str]) -> None:
        for text in texts:
            if self._re.search(text):
                raise ApiError(
                    400,
                    "the request was refused by the gateway's content policy",
                    code="content_policy_violation",
                    reason="deny_list",
                )


Ask = Callable[[str, list[dict[str, str]], float], Awaitable[str]]


class ModerationHook:
    """Asks a moderation model served by Sarv (Llama Guard answers ``safe`` or ``unsafe\\nS<n>``)."""

    name = "moderation"

    def __init__(self, model: str, ask: Ask, *, timeout: float, fail_open: bool) -> None:
        self._model = model
        self._ask = ask
        self._timeout = timeout
        self._fail_open = fail_open

    async def __call__(self, model: str, texts: list[str]) -> None:
        if model == self._model:
            return
        try:
            verdict = await self._ask(
                self._model, [{"role": "user", "content": "\n".join(texts)}], self._timeout
            )
        except ApiError as exc:
            if self._fail_open:
                return
            raise ApiError(
                503, f"moderation model unavailable: {exc.message}", code="moderation_unavailable"
            ) from None
        if verdict.strip().lower().startswith("unsafe"):
            raise ApiError(
                400,
                "the request was refused by the moderation model",
                code="content_policy_violation",
                reason="moderation",
            )


class Guardrails:
    """The configured hooks of one gateway; ``active`` is False when everything is off (the default)."""

    def __init__(self, config: GuardrailConfig, ask: Ask, *, metrics: GatewayMetrics | None = None) -> None:
        """``ask`` is the moderation hook's channel to a served model; ``metrics`` counts refusals and
        redactions."""
        self._metrics = metrics
        self.pre: list[PreRequestHook] = []
        if config.deny_patterns:
            self.pre.append(DenyListHook(config.deny_patterns))
        if config.moderation_model:
            self.pre.append(
                ModerationHook(
                    config.moderation_model,
                    ask,
                    timeout=config.moderation_timeout_s,
                    fail_open=config.moderation_fail_open,
                )
            )
        pii = [(re.compile(p), f"[{label}]") for label, p in PII_PATTERNS.items()]
        self.input_filter = TextFilter(pii) if config.redact_pii_input else None
        out_rules: list[tuple[re.Pattern[str], str]] = [
            (re.compile(p, re.IGNORECASE), "[blocked]") for p in config.deny_output_patterns
        ]
        if config.redact_pii_output:
            out_rules.extend(pii)
        self.output_filter = TextFilter(out_rules) if out_rules else None

    @property
    def active(self) -> bool:
        return bool(self.pre) or self.input_filter is not None or self.output_filter is not None

    async def screen_input(self, model: str, req: BaseModel, texts: list[str], body: bytes) -> bytes:
        """Run the pre-request hooks on the prompt's ``texts``, then redact PII in the validated ``req``.

        Returns the body to forward: the client's own bytes, or ``req`` re-serialised when something was
        redacted (the body is parsed once, by the request stage, either way)."""
        m = self._metrics
        for hook in self.pre:
            try:
                await hook(model, texts)
            except ApiError as exc:
                if m is not None:
                    m.guardrail_actions.labels(hook.name, "refused").inc()
                raise exc from None
        if self.input_filter is not None and self.redact_request(req):
            if m is not None:
                m.guardrail_actions.labels("pii_input", "redacted").inc()
            # Only the fields the client sent (its extra fields included), as it sent them but redacted.
            return req.model_dump_json(exclude_unset=True).encode()
        return body

    def redact_request(self, req: BaseModel) -> bool:
        """Redact PII in a validated request's prompt or messages in place; True when anything changed."""
        f = self.input_filter
        if f is None:
            return False
        changed = False

        def fix(s: str) -> str:
            nonlocal changed
            out = f.apply(s)
            changed = changed or out != s
            return out

        if isinstance(req, CompletionRequest):
            prompt = req.prompt
            if isinstance(prompt, str):
                req.prompt = fix(prompt)
            elif prompt and isinstance(prompt[0], str):
                req.prompt = [fix(p) for p in prompt]
        elif isinstance(req, ChatCompletionRequest):
            for msg in req.messages:
                content = msg.content
                if isinstance(content, str):
                    msg.content = fix(content)
                elif content is not None:
                    for part in content:
                        if part.text is not None:
                            part.text = fix(part.text)
        return changed
