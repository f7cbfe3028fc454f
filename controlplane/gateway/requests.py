"""Is the request sane: its body read within bounds, parsed once, checked against caps and measured."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import cast

from pydantic import BaseModel, ValidationError

from controlplane._multipart import boundary, form_fields
from controlplane.errors import ConfigError
from controlplane.gateway.asgi import Connection, Receive, Scope, connection
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.errors import ApiError
from controlplane.gateway.ratelimit import Level
from controlplane.gateway.routing import Router
from controlplane.gateway.schemas import (
    AudioRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    PassThroughRequest,
    ResponsesRequest,
)
from controlplane.gateway.tokens import PromptInfo, TokenCounter, verified_tokenizer

__all__ = ["ENDPOINTS", "PASS_THROUGH", "PromptParts", "RequestChecks", "prompt_parts"]

PASS_THROUGH: dict[str, type[PassThroughRequest]] = {
    "/v1/responses": ResponsesRequest,
    "/v1/rerank": PassThroughRequest,
    "/v1/score": PassThroughRequest,
    "/rerank": PassThroughRequest,
    "/score": PassThroughRequest,
    "/tokenize": PassThroughRequest,
    "/detokenize": PassThroughRequest,
    "/v1/audio/transcriptions": AudioRequest,
    "/v1/audio/translations": AudioRequest,
}
"""The other routes a vLLM replica serves: routed by ``model`` and forwarded untouched, with the same key,
model and limit checks as the others. Audio bodies are ``multipart/form-data``, the rest JSON."""

logger = logging.getLogger(__name__)

ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    **PASS_THROUGH,
}
"""The proxied routes and the schema each body is validated against."""

_FORM_FIELDS = frozenset({"model", "stream"})
# Strings of a pass-through body counted towards its prompt, at most this many (a lower bound suffices).
_MAX_STRINGS = 4096

PromptParts = tuple[list[str], list[list[int]], int]
"""(texts, token-id prompts, number of chat messages) of a validated request."""

# pydantic's error locations include the union member tried ("prompt.list[int]"): not a field name.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z][A-Za-z]+)$")
# Prompts longer than this (characters) are tokenised off the event loop.
_THREAD_CHARS = 16384


def prompt_parts(req: BaseModel) -> PromptParts:
    """The texts and token ids a request asks the model to read: computed once per request, then
    shared by the token count, the prefix hashes and the guardrails."""
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(req, ChatCompletionRequest):
        for m in req.messages:
            if isinstance(m.content, str):
                texts.append(m.content)
            else:
                texts.append("".join(p.text or "" for p in m.content or ()))
        return texts, ids, len(req.messages)
    if isinstance(req, PassThroughRequest):
        # Whatever text the body holds (query, documents, input items …): a lower bound of its tokens.
        _strings(req.model_extra or {}, texts)
        return texts, ids, 0
    if isinstance(req, CompletionRequest | EmbeddingRequest):
        prompt = req.prompt if isinstance(req, CompletionRequest) else req.input
        if isinstance(prompt, str):
            return [prompt], ids, 0
        for item in prompt:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                return texts, [cast("list[int]", prompt)], 0
            else:
                ids.append(item)
    return texts, ids, 0


def _strings(value: object, out: list[str]) -> None:
    stack = [value]
    while stack and len(out) < _MAX_STRINGS:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _cap(param: str, value: int | None, limit: int) -> None:
    if value is not None and value > limit:
        raise ApiError(
            400,
            f"'{param}' is {value}; the maximum is {limit}",
            param=param,
            code="invalid_value",
            reason=param,
        )


class RequestChecks:
    """The request stage of one gateway (built once): every refusal here is the client's mistake (4xx)."""

    def __init__(
        self,
        config: GatewayConfig,
        router: Router,
        *,
        on_tokenizer: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._config = config
        self._limits = config.limits
        self._router = router
        self._on_tokenizer = on_tokenizer
        """Told, per served model, whether its counts are exact (a tokenizer) or the byte bound."""
        self._weights: dict[str, str] = {}
        """Served model → the weights ref its counter was loaded from (or is loading from)."""
        self._loads: set[asyncio.Task[None]] = set()
        lim = config.limits
        r = config.routing
        self._counters: dict[str, TokenCounter] = {}
        self._default_counter = TokenCounter(
            tokenizer_path=None,
            max_bytes_per_token=lim.max_bytes_per_token,
            block_tokens=r.block_tokens,
            block_bytes=r.block_bytes,
            max_blocks=r.max_blocks,
        )

    async def load_tokenizers(self) -> None:
        """Load the tokenizers the config names (exact prompt lengths for those models)."""
        lim = self._limits
        r = self._config.routing
        for model, over in self._config.models.items():
            if over.tokenizer is not None and model not in self._counters:
                self._counters[model] = await asyncio.to_thread(
                    TokenCounter,
                    tokenizer_path=over.tokenizer,
                    max_bytes_per_token=lim.max_bytes_per_token,
                    block_tokens=r.block_tokens,
                    block_bytes=r.block_bytes,
                    max_blocks=r.max_blocks,
                )

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body, refused past ``max_body_bytes`` (declared or received) or ``body_timeout_s``."""
        limit = self._limits.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise ApiError(400, "invalid Content-Length", code="invalid_request") from None
                if declared > limit:
                    raise ApiError(
                        413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large"
                    )
                break
        conn = connection(scope)
        if conn is None:  # another ASGI server: a timeout around the reads
            try:
                async with asyncio.timeout(self._limits.body_timeout_s):
                    return await self._read(receive, limit, None)
            except TimeoutError:
                raise self._body_timeout() from None
        conn.expect_body(self._limits.body_timeout_s)
        return await self._read(receive, limit, conn)

    async def _read(self, receive: Receive, limit: int, conn: Connection | None) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if conn is not None and conn.body_expired:
                raise self._body_timeout()
            if msg["type"] == "http.disconnect":
                raise ApiError(400, "client went away", code="client_disconnected")
            part: bytes = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(part)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _body_timeout(self) -> ApiError:
        return ApiError(
            408, f"request body not received within {self._limits.body_timeout_s:g}s", code="timeout"
        )

    def parse(self, schema: type[BaseModel], body: bytes) -> BaseModel:
        """The validated request: the one parse of the body the gateway makes."""
        try:
            return schema.model_validate_json(body)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            if err["type"] == "json_invalid":
                raise ApiError(
                    400, f"malformed JSON body: {err['msg']}", code="invalid_json", reason="invalid_json"
                ) from None
            loc = [str(p) for p in err.get("loc", ())]
            # Unions report the member type tried ("prompt.str"); name the field the client wrote.
            field = ".".join(p for p in loc if not _TYPE_TAG.match(p))
            field = field or "body"
            msg = str(err["msg"]).removeprefix("Value error, ")
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise ApiError(
                400,
                f"invalid '{field}': {msg}{more}",
                param=field,
                code="invalid_value",
                reason="invalid_field",
            ) from None

    def parse_form(self, scope: Scope, body: bytes) -> AudioRequest:
        """The ``model`` (and ``stream``) fields of a ``multipart/form-data`` body, nothing else of it."""
        ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        sep = boundary(ctype)
        if sep is None:
            raise ApiError(
                415,
                f"{scope['path']} takes a multipart/form-data body (the audio file and its fields)",
                code="unsupported_media_type",
                reason="media_type",
            )
        fields = form_fields(body, sep, _FORM_FIELDS)
        model = fields.get("model", "").strip()
        if not model or len(model) > 256:
            raise ApiError(
                400,
                "invalid 'model': the form field 'model' is required (1-256 characters)",
                param="model",
                code="invalid_value",
                reason="invalid_field",
            )
        return AudioRequest(model=model, stream=fields.get("stream", "").lower() == "true")

    def resolve_model(self, levels: tuple[Level, ...], req: BaseModel, path: str | None = None) -> str:
        """The requested model, when a replica serves it and each level (key, team, organisation) allows."""
        model = str(getattr(req, "model", ""))
        if not self._router.serves(model):
            where = f" to answer {path}" if path in PASS_THROUGH else ""
            raise ApiError(
                404,
                f"the model '{model}' does not exist or has no ready replica{where}",
                param="model",
                code="model_not_found",
                reason="unknown_model",
            )
        self.check_allowed(levels, model)
        return model

    @staticmethod
    def check_allowed(levels: tuple[Level, ...], model: str) -> None:
        """403 unless each level (key, team, organisation) allows ``model``."""
        for level in levels:
            if level.models and model not in level.models:
                raise ApiError(
                    403,
                    f"{level.label} may not use the model '{model}'",
                    param="model",
                    code="model_not_allowed",
                    reason="model_not_allowed",
                )

    def check_caps(self, req: BaseModel) -> None:
        lim = self._limits
        if isinstance(req, CompletionRequest | ChatCompletionRequest):
            _cap("max_tokens", req.max_tokens, lim.max_tokens_cap)
            _cap("n", req.n, lim.max_n)
            if isinstance(req.stop, list):
                _cap("stop", len(req.stop), lim.max_stop_sequences)
        if isinstance(req, CompletionRequest):
            _cap("best_of", req.best_of, lim.max_best_of)
            _cap("logprobs", req.logprobs, lim.max_logprobs)
            if isinstance(req.prompt, list):
                _cap("prompt", len(req.prompt), lim.max_prompt_items)
        elif isinstance(req, ChatCompletionRequest):
            _cap("max_completion_tokens", req.max_completion_tokens, lim.max_tokens_cap)
            _cap("top_logprobs", req.top_logprobs, lim.max_logprobs)
            _cap("messages", len(req.messages), lim.max_prompt_items)
        elif isinstance(req, EmbeddingRequest) and isinstance(req.input, list):
            _cap("input", len(req.input), lim.max_prompt_items)
        elif isinstance(req, ResponsesRequest):
            _cap("max_output_tokens", req.max_output_tokens, lim.max_tokens_cap)

    async def measure(self, model: str, parts: PromptParts, req: BaseModel | None = None) -> PromptInfo:
        """The prompt's tokens (exact with the model's tokenizer, and its chat template for a chat) and
        prefix blocks."""
        texts, ids, messages = parts
        self._follow_weights(model)
        counter = self._counters.get(model, self._default_counter)
        roles = [str(m.role) for m in req.messages] if isinstance(req, ChatCompletionRequest) else None
        if counter.exact and sum(len(t) for t in texts) > _THREAD_CHARS:
            # Long prompts take milliseconds to tokenise: off the event loop (the Rust side drops the GIL).
            return await asyncio.to_thread(counter.measure, texts, ids, messages, roles)
        return counter.measure(texts, ids, messages, roles)

    def _follow_weights(self, model: str) -> None:
        """Load the model's tokenizer from the weights its replicas run, once per weights revision, in the
        background (until it is loaded the byte bound counts); a configured tokenizer always wins."""
        cache = self._config.model_cache
        over = self._config.models.get(model)
        if cache is None or (over is not None and over.tokenizer is not None):
            return
        ref = next((v.weights for v in self._router.models().get(model, ()) if v.weights), None)
        if ref is None or self._weights.get(model) == ref:
            return
        self._weights[model] = ref
        task = asyncio.get_running_loop().create_task(self._load_from_weights(model, cache / ref))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load_from_weights(self, model: str, directory: Path) -> None:
        lim, r = self._limits, self._config.routing
        try:
            path, tok_config = await asyncio.to_thread(verified_tokenizer, directory)
            counter = await asyncio.to_thread(
                TokenCounter,
                tokenizer_path=path,
                max_bytes_per_token=lim.max_bytes_per_token,
                block_tokens=r.block_tokens,
                block_bytes=r.block_bytes,
                max_blocks=r.max_blocks,
                tokenizer_config=tok_config,
            )
        except ConfigError as exc:
            logger.warning("prompt lengths of %s stay a byte bound: %s", model, exc.message)
            self._counters.pop(model, None)
            if self._on_tokenizer is not None:
                self._on_tokenizer(model, False)
            return
        self._counters[model] = counter
        if self._on_tokenizer is not None:
            self._on_tokenizer(model, True)

    def max_context(self, model: str) -> int:
        over = self._config.models.get(model)
        if over is not None and over.max_context:
            return over.max_context
        return self._router.max_context(model) or self._limits.default_max_context

    def check_lengths(self, levels: tuple[Level, ...], req: BaseModel, model: str, info: PromptInfo) -> int:
        """Refuse prompts over the context or a level's cap; return the tokens to reserve."""
        if isinstance(req, PassThroughRequest):
            # A lower bound of the text, not one prompt (rerank's documents are scored one by one): no
            # context check here, the engine makes its own. Generating routes reserve their output too.
            if isinstance(req, ResponsesRequest):
                return info.tokens + (req.max_output_tokens or self._limits.default_max_tokens)
            if isinstance(req, AudioRequest):
                return info.tokens + self._limits.default_max_tokens
            return info.tokens
        context = self.max_context(model)
        bound = "" if info.exact else "at least "
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if info.tokens > context:
            raise ApiError(
                400,
                f"the prompt is {bound}{info.tokens} tokens; the model '{model}' accepts at most {context}",
                param=param,
                code="context_length_exceeded",
                reason="context_length",
            )
        for level in levels:
            cap = level.max_prompt_tokens
            if cap is not None and info.tokens > cap:
                raise ApiError(
                    400,
                    f"the prompt is {bound}{info.tokens} tokens; {level.label} allows at most {cap}",
                    param=param,
                    code="prompt_too_long",
                    reason=f"{level.kind}_prompt_cap",
                )
        if isinstance(req, EmbeddingRequest):
            return info.tokens
        asked: int | None = None
        ways = 1
        if isinstance(req, CompletionRequest):
            asked = req.max_tokens
            ways = max(req.n, req.best_of or 1)
        elif isinstance(req, ChatCompletionRequest):
            asked = req.max_tokens or req.max_completion_tokens
            ways = req.n
        if asked is not None and info.tokens + asked > context:
            raise ApiError(
                400,
                f"the prompt ({bound}{info.tokens} tokens) plus max_tokens ({asked}) exceeds "
                f"the context of '{model}' ({context} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
                reason="context_length",
            )
        return info.tokens + (asked or self._limits.default_max_tokens) * ways
