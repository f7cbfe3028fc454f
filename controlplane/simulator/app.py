"""The simulator's ASGI app: vLLM's OpenAI-compatible routes, ``/health`` and ``/metrics``.

Raw ASGI rather than a framework: the simulator is the upstream of gateway benchmarks with hundreds of
concurrent streams on one core, so per-request and per-token work is kept to a dictionary lookup, one
small JSON encoding and one ``send``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import math
import os
import random
import secrets
import struct
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from controlplane.errors import describe_validation_error
from controlplane.simulator.config import LatencyMode, SimConfig, SimTask
from controlplane.simulator.engine import BatchEngine, ClientGone, Slot
from controlplane.simulator.metrics import SimMetrics
from controlplane.simulator.protocol import ChatRequest, CompletionRequest, EmbeddingRequest
from controlplane.simulator.tokens import generate_pieces, render_chat, text_seed, tokenize

__all__ = ["SimApp", "create_app"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_M = TypeVar("_M", bound=BaseModel)
_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]


class _LoadLora(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class _UnloadLora(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest``."""

    lora_name: str
    lora_int_id: int | None = None


def runtime_lora_updating() -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``1`` or ``true`` (any case) turns the endpoints on."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


_MAX_BODY = 32 * 1024 * 1024
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_METRICS_TYPE = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
_DONE = b"data: [DONE]\n\n"


class _HTTPError(Exception):
    """An OpenAI-shaped error answer, raised before any response byte is sent."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


def _bad_request(message: str, param: str | None = None) -> _HTTPError:
    return _HTTPError(400, message, "BadRequestError", param)


def _exit_process() -> None:
    sys.stderr.write("sim: crash_after reached, exiting with status 1\n")
    sys.stderr.flush()
    os._exit(1)


class _Choice:
    """One output sequence: its tokens and why it ends."""

    __slots__ = ("finish", "pieces", "stop_reason")

    def __init__(self, pieces: list[str], finish: str, stop_reason: str | None) -> None:
        self.pieces = pieces
        self.finish = finish
        self.stop_reason = stop_reason


@dataclass(frozen=True, slots=True)
class _Run:
    """Everything one admitted generation request needs while it produces tokens."""

    scope: Scope
    send: Send
    loop: asyncio.AbstractEventLoop
    gone: asyncio.Future[Message]
    chat: bool
    request: CompletionRequest | ChatRequest
    slot: Slot
    choices: list[_Choice]


class SimApp:
    """One simulated replica. ``SimApp(config)`` is the ASGI callable; state lives on the instance."""

    def __init__(self, config: SimConfig, *, on_crash: Callable[[], None] | None = None) -> None:
        self.config = config
        self.metrics = SimMetrics(
            config.served_model_name,
            config.max_model_len,
            config.adapter_names,
            max_lora=len(config.lora_modules),
            cache_info={
                "block_size": str(config.block_size),
                "num_gpu_blocks": str(config.kv_cache_tokens // config.block_size),
                "enable_prefix_caching": str(config.enable_prefix_caching),
            },
        )
        self.engine = BatchEngine(config, self.metrics)
        self._rng = random.Random(config.seed)  # noqa: S311 - reproducible failure draws, not security
        self._ready_at = time.monotonic() + config.slow_start_s
        self._finished = 0
        self._crashing = False
        self._on_crash = on_crash or _exit_process
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)
        self._adapters: dict[str, str] = {}
        for module in config.lora_modules:
            name, _, path = module.partition("=")
            self._adapters[name] = path or name
        self._models_body = self._render_models()
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/embeddings"): self._embeddings,
        }
        self._awake = asyncio.Event()
        self._awake.set()
        if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
            # As vLLM: sleep mode's routes are development endpoints, registered only in dev mode.
            self._routes[("POST", "/sleep")] = self._sleep
            self._routes[("POST", "/wake_up")] = self._wake_up
            self._routes[("GET", "/is_sleeping")] = self._is_sleeping
        if runtime_lora_updating():
            # As vLLM: the routes exist only when runtime adapter updating is allowed.
            self._routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            self._routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora
        self._paths = {path for _, path in self._routes}
        self._bearer = None if config.api_key is None else b"Bearer " + config.api_key.encode()

    # --- ASGI entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        try:
            bearer = self._bearer
            if bearer is not None and scope["path"].startswith("/v1") and not _authorized(scope, bearer):
                await _respond(send, 401, b'{"error":"Unauthorized"}', _JSON)
                return
            if handler is None:
                if scope["path"] in self._paths:
                    raise _HTTPError(405, "Method Not Allowed", "MethodNotAllowed")
                raise _HTTPError(404, f"no route {scope['path']}", "NotFoundError")
            if not self._awake.is_set() and scope["path"] in _GENERATE:
                await self._awake.wait()  # a sleeping engine holds requests until it is woken up
            await handler(scope, receive, send)
        except _HTTPError as err:
            body = {
                "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}
            }
            await _respond(send, err.status, to_json(body), _JSON)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- plain routes

    def _check_ready(self) -> None:
        if time.monotonic() < self._ready_at:
            raise _HTTPError(503, "the engine is still starting; retry shortly", "ServiceUnavailableError")

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._check_ready()
        await _respond(send, 200, b"", [])  # vLLM answers an empty 200

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, self.metrics.render(), _METRICS_TYPE)

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b'{"version":"sarv-sim"}', _JSON)

    def _render_models(self) -> bytes:
        cfg = self.config
        created = int(time.time())
        root = cfg.model or cfg.served_model_name
        cards: list[dict[str, Any]] = [
            {
                "id": cfg.served_model_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": cfg.max_model_len,
            }
        ]
        for name, path in self._adapters.items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": cfg.served_model_name,
                    "max_model_len": None,
                }
            )
        return to_json({"object": "list", "data": cards})

    # --- sleep mode

    async def _sleep(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.config.enable_sleep_mode:
            raise _HTTPError(
                400, "Sleep mode is not enabled: start the engine with --enable-sleep-mode", "BadRequestError"
            )
        query = dict(p.partition("=")[::2] for p in scope.get("query_string", b"").decode().split("&") if p)
        level = query.get("level", "1")
        if level not in {"0", "1", "2"}:
            raise _bad_request(f"level must be 0, 1 or 2, not {level!r}", "level")
        if self._awake.is_set():
            self._awake.clear()  # new requests wait for the wake-up from now on
            await asyncio.sleep(self.config.sleep_s)
            self.metrics.sleep_level = max(1, int(level))
        await _respond(send, 200, to_json({"status": "sleeping", "level": int(level)}), _JSON)

    async def _wake_up(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._awake.is_set():
            level2 = self.metrics.sleep_level == 2
            await asyncio.sleep(self.config.wake_level2_s if level2 else self.config.wake_s)
            self.metrics.sleep_level = 0
            self._awake.set()
        await _respond(send, 200, to_json({"status": "awake", "tags": None}), _JSON)

    async def _is_sleeping(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, to_json({"is_sleeping": not self._awake.is_set()}), _JSON)

    async def _load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/load_lora_adapter`` with vLLM's checks and answers (a text body on success)."""
        req = await self._parse(receive, _LoadLora)
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise _HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.config.served_model_name:
            raise _HTTPError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if name in self._adapters and not req.load_inplace:
            raise _HTTPError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if not os.path.isdir(path):
            # vLLM's LoRAAdapterNotFoundError, answered 404.
            raise _HTTPError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self._adapters[name] = path
        self.metrics.lora_running.setdefault(name, 0)
        self.metrics.lora_waiting.setdefault(name, 0)
        self._models_body = self._render_models()
        await _respond(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), _TEXT)

    async def _unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/unload_lora_adapter``: 404 for a name that is not loaded, as vLLM answers."""
        req = await self._parse(receive, _UnloadLora)
        name = req.lora_name
        if not name:
            raise _HTTPError(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        if name not in self._adapters:
            raise _HTTPError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self._adapters[name]
        self._models_body = self._render_models()
        await _respond(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), _TEXT)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._check_ready()
        await _respond(send, 200, self._models_body, _JSON)

    # --- shared request steps

    async def _parse(self, receive: Receive, model: type[_M]) -> _M:
        self._check_ready()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > _MAX_BODY:
                raise _HTTPError(413, f"request body exceeds {_MAX_BODY} bytes", "RequestTooLarge")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as exc:
            raise _bad_request(describe_validation_error(exc, what="request")) from None

    def _adapter_for(self, model: str) -> str | None:
        if model == self.config.served_model_name:
            return None
        if model in self._adapters:
            return model
        raise _HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def _inject_failure(self, receive: Receive) -> None:
        """Draw this request's fate: answered, a 500, or never answered."""
        cfg = self.config
        if not (cfg.failure_rate or cfg.hang_rate):
            return
        draw = self._rng.random()
        if draw < cfg.failure_rate:
            self._request_done()
            raise _HTTPError(500, "simulated engine failure (failure_rate)", "InternalServerError")
        if draw < cfg.failure_rate + cfg.hang_rate:
            # Never answer: wait until the client gives up (or the server shuts down).
            while (await receive())["type"] != "http.disconnect":
                pass
            raise ClientGone

    def _request_done(self) -> None:
        self._finished += 1
        crash_after = self.config.crash_after
        if crash_after is not None and self._finished >= crash_after and not self._crashing:
            self._crashing = True
            # A moment's grace so the response that reached the limit is flushed to its client.
            asyncio.get_running_loop().call_later(0.05, self._on_crash)

    def _output_limit(self, prompt_tokens: int, requested: int | None, default: int) -> tuple[int, bool]:
        """(tokens to generate, whether the limit came from the request)."""
        cfg = self.config
        if prompt_tokens >= cfg.max_model_len:
            raise _bad_request(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the input.",
                "prompt",
            )
        if cfg.latency_mode is LatencyMode.FIXED:
            return cfg.fixed_output_tokens, False
        if requested is None:
            return min(default, cfg.max_model_len - prompt_tokens), False
        if prompt_tokens + requested > cfg.max_model_len:
            raise _bad_request(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the input, {requested} "
                "in the completion). Please reduce the length of the input or completion.",
                "max_tokens",
            )
        return requested, True

    def _choices(
        self, seed: int, n: int, count: int, from_request: bool, stops: Sequence[str]
    ) -> list[_Choice]:
        out: list[_Choice] = []
        for i in range(n):
            pieces = generate_pieces(seed + i, count)
            finish, stop_reason = ("length" if from_request else "stop"), None
            if stops:
                text = "".join(pieces)
                hits = [(text.find(s), s) for s in stops if s in text]
                if hits:
                    cut, stop_reason = min(hits)
                    pieces, finish = _truncate(pieces, cut), "stop"
            out.append(_Choice(pieces, finish, stop_reason))
        return out

    def _slot(self, tokens: Sequence[Any], max_output: int, n: int, adapter: str | None) -> Slot:
        slot = self.engine.prepare(tokens, max_output, n, adapter, asyncio.get_running_loop().time())
        if slot.total_blocks > self.engine.cache.capacity or n > self.config.max_num_seqs:
            raise _bad_request(
                f"the request needs {slot.total_blocks} KV blocks for {n} sequences, more than the "
                f"replica holds ({self.engine.cache.capacity} blocks, "
                f"max_num_seqs {self.config.max_num_seqs})",
                "n",
            )
        return slot

    def _finish_metrics(self, slot: Slot, choices: list[_Choice], max_tokens: int | None, now: float) -> None:
        m = self.metrics
        generated = sum(len(c.pieces) for c in choices)
        m.prompt_tokens += slot.prompt_tokens
        m.generation_tokens += generated
        for c in choices:
            m.success[c.finish] += 1
            m.request_generation.observe(len(c.pieces))
        m.request_prompt.observe(slot.prompt_tokens)
        if max_tokens is not None:
            m.request_max_tokens.observe(max_tokens)
        m.e2e.observe(now - slot.arrival)
        m.inference.observe(now - slot.started)
        m.prefill.observe(slot.first_token - slot.started)
        m.decode.observe(now - slot.first_token)

    def _usage(self, slot: Slot, choices: list[_Choice]) -> dict[str, Any]:
        generated = sum(len(c.pieces) for c in choices)
        return {
            "prompt_tokens": slot.prompt_tokens,
            "total_tokens": slot.prompt_tokens + generated,
            "completion_tokens": generated,
            "prompt_tokens_details": {"cached_tokens": slot.cached_tokens},
        }

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        chat: bool,
        request: CompletionRequest | ChatRequest,
        prompt: str | list[int],
        requested: int | None,
        default_len: int,
    ) -> None:
        adapter = self._adapter_for(request.model)
        if self.config.task is SimTask.EMBED:
            raise _bad_request("this model serves embeddings only; use /v1/embeddings", "model")
        tokens: Sequence[Any] = tokenize(prompt) if isinstance(prompt, str) else prompt
        max_output, from_request = self._output_limit(len(tokens), requested, default_len)
        slot = self._slot(tokens, max_output, request.n, adapter)
        await self._inject_failure(receive)
        base_seed = (
            request.seed
            if request.seed is not None
            else text_seed(self.config.seed, prompt if isinstance(prompt, str) else repr(prompt))
        )
        choices = self._choices(base_seed, request.n, max_output, from_request, request.stops)
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[Message] = asyncio.ensure_future(receive())
        try:
            try:
                await self.engine.acquire(slot, gone, loop)
            except ClientGone:
                self.metrics.success["abort"] += slot.seqs
                return
            run = _Run(scope, send, loop, gone, chat, request, slot, choices)
            try:
                if request.stream:
                    await self._stream(run)
                else:
                    await self._whole(run)
            except ClientGone:
                self.metrics.success["abort"] += slot.seqs
                return
            finally:
                self.engine.release(slot, loop.time())
            self._finish_metrics(slot, choices, requested, loop.time())
            self._request_done()
        finally:
            gone.cancel()

    async def _whole(self, run: _Run) -> None:
        scope, send, loop, gone = run.scope, run.send, run.loop, run.gone
        chat, request, slot, choices = run.chat, run.request, run.slot, run.choices
        engine = self.engine
        await _sleep_until(loop, slot.started + engine.ttft(slot), gone)
        slot.first_token = loop.time()
        self.metrics.ttft.observe(slot.first_token - slot.arrival)
        steps = max(len(c.pieces) for c in choices)
        if steps > 1:
            itl = engine.itl()
            await _sleep_until(loop, slot.first_token + itl * (steps - 1), gone)
            self.metrics.itl.observe(itl, (steps - 1) * len(choices))
        slot.last_token = loop.time()
        rid = self._request_id(chat)
        created = int(time.time())
        body: dict[str, Any]
        if chat:
            body = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": request.model,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": "".join(c.pieces), "tool_calls": []},
                        "logprobs": None,
                        "finish_reason": c.finish,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": self._usage(slot, choices),
            }
        else:
            body = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": request.model,
                "choices": [
                    {
                        "index": i,
                        "text": "".join(c.pieces),
                        "logprobs": None,
                        "finish_reason": c.finish,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": self._usage(slot, choices),
            }
        await _respond(send, 200, to_json(body), _with_request_id(scope, _JSON))

    async def _stream(self, run: _Run) -> None:
        scope, send, loop, gone = run.scope, run.send, run.loop, run.gone
        chat, request, slot, choices = run.chat, run.request, run.slot, run.choices
        engine = self.engine
        metrics = self.metrics
        rid = self._request_id(chat)
        created = int(time.time())
        model = request.model
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def event(index: int, text: str | dict[str, str] | None, choice: _Choice | None, last: bool) -> bytes:
            entry: dict[str, Any]
            if chat:
                delta = text if isinstance(text, dict) else ({} if text is None else {"content": text})
                entry = {"index": index, "delta": delta, "logprobs": None}
            else:
                entry = {"index": index, "text": text or "", "logprobs": None}
            entry["finish_reason"] = choice.finish if last and choice else None
            if last and choice:
                entry["stop_reason"] = choice.stop_reason
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [entry]}
            return b"data: " + to_json(chunk) + b"\n\n"

        deadline = slot.started + engine.ttft(slot)
        await _sleep_until(loop, deadline, gone)
        slot.first_token = prev = loop.time()
        metrics.ttft.observe(slot.first_token - slot.arrival)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": _with_request_id(scope, _SSE),
            }
        )
        steps = max(1, *(len(c.pieces) for c in choices))
        # Chat streams open with one role-only delta per choice, sent together with the first tokens.
        head = [
            event(i, {"role": "assistant", "content": ""}, None, False)
            for i in range(len(choices) if chat else 0)
        ]
        for step in range(steps):
            if step:
                deadline += engine.itl()
                await _sleep_until(loop, deadline, gone)
                now = loop.time()
                metrics.itl.observe(now - prev)
                prev = now
            parts = head
            head = []
            for i, c in enumerate(choices):
                n = len(c.pieces)
                if step < n:
                    parts.append(event(i, c.pieces[step], c, step == n - 1))
                elif step == 0:  # an empty output (a stop string at the very start) still ends its choice
                    parts.append(event(i, None if chat else "", c, True))
            if step == steps - 1:
                if include_usage:
                    usage = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
                    usage["usage"] = self._usage(slot, choices)
                    parts.append(b"data: " + to_json(usage) + b"\n\n")
                parts.append(_DONE)
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": step < steps - 1})
        slot.last_token = loop.time()

    def _request_id(self, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{self._id_prefix}{next(self._ids)}"

    # --- inference routes

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = await self._parse(receive, CompletionRequest)
            if request.echo:
                raise _bad_request("echo is not supported by the simulator", "echo")
            await self._generate(
                scope,
                receive,
                send,
                chat=False,
                request=request,
                prompt=request.prompt_text_or_ids,
                requested=request.max_tokens,
                default_len=self.config.output_tokens,
            )
        except ClientGone:
            return

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = await self._parse(receive, ChatRequest)
            prompt = render_chat([(m.role, m.text) for m in request.messages])
            await self._generate(
                scope,
                receive,
                send,
                chat=True,
                request=request,
                prompt=prompt,
                requested=request.output_limit,
                default_len=self.config.output_tokens,
            )
        except ClientGone:
            return

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = await self._parse(receive, EmbeddingRequest)
            await self._embed(scope, receive, send, request)
        except ClientGone:
            return

    async def _embed(self, scope: Scope, receive: Receive, send: Send, request: EmbeddingRequest) -> None:
        cfg = self.config
        adapter = self._adapter_for(request.model)
        if cfg.task is not SimTask.EMBED:
            raise _bad_request("this model does not serve embeddings; start the simulator with --task embed")
        dim = request.dimensions or cfg.embedding_dim
        if dim > cfg.embedding_dim:
            raise _bad_request(f"dimensions must be at most {cfg.embedding_dim}", "dimensions")
        inputs = request.inputs
        token_lists: list[Sequence[Any]] = [tokenize(x) if isinstance(x, str) else x for x in inputs]
        for tokens in token_lists:
            if len(tokens) > cfg.max_model_len:
                raise _bad_request(
                    f"This model's maximum context length is {cfg.max_model_len} tokens. However, an "
                    f"input has {len(tokens)} tokens. Please reduce the length of the input.",
                    "input",
                )
        flat = [t for tokens in token_lists for t in tokens]
        slot = self._slot(flat, 0, 1, adapter)
        slot.hashes = []  # pooling models run without the prefix cache, as in vLLM
        await self._inject_failure(receive)
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[Message] = asyncio.ensure_future(receive())
        try:
            try:
                await self.engine.acquire(slot, gone, loop)
            except ClientGone:
                self.metrics.success["abort"] += 1
                return
            try:
                await _sleep_until(loop, slot.started + self.engine.ttft(slot), gone)
            except ClientGone:
                self.metrics.success["abort"] += 1
                return
            finally:
                self.engine.release(slot, loop.time())
            now = loop.time()
            slot.first_token = now
            m = self.metrics
            m.prompt_tokens += slot.prompt_tokens
            m.success["stop"] += 1
            m.request_prompt.observe(slot.prompt_tokens)
            m.ttft.observe(now - slot.arrival)
            m.e2e.observe(now - slot.arrival)
            data = []
            for i, x in enumerate(inputs):
                vector = _embedding(text_seed(cfg.seed, x if isinstance(x, str) else repr(x)), dim)
                value: list[float] | str = vector
                if request.encoding_format == "base64":
                    value = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
                data.append({"object": "embedding", "index": i, "embedding": value})
            body = {
                "id": f"embd-{self._id_prefix}{next(self._ids)}",
                "object": "list",
                "created": int(time.time()),
                "model": request.model,
                "data": data,
                "usage": {
                    "prompt_tokens": slot.prompt_tokens,
                    "total_tokens": slot.prompt_tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
            await _respond(send, 200, to_json(body), _with_request_id(scope, _JSON))
            self._request_done()
        finally:
            gone.cancel()


def _truncate(pieces: list[str], cut: int) -> list[str]:
    """Tokens of ``"".join(pieces)[:cut]``; a token cut by the stop string is kept in part."""
    out: list[str] = []
    pos = 0
    for p in pieces:
        if pos + len(p) <= cut:
            out.append(p)
            pos += len(p)
            continue
        if cut > pos:
            out.append(p[: cut - pos])
        break
    return out


def _embedding(seed: int, dim: int) -> list[float]:
    rng = random.Random(seed)  # noqa: S311 - deterministic test vectors
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


async def _sleep_until(
    loop: asyncio.AbstractEventLoop, deadline: float, gone: asyncio.Future[Message]
) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    if gone.done():
        raise ClientGone


def _authorized(scope: Scope, bearer: bytes) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return secrets.compare_digest(value, bearer)
    return False


def _with_request_id(scope: Scope, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            return [*headers, (b"x-request-id", value)]
    return headers


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


_GENERATE = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})


def create_app(config: SimConfig, *, on_crash: Callable[[], None] | None = None) -> SimApp:
    """The ASGI app of one simulated replica. ``on_crash`` replaces the process exit of ``crash_after``."""
    return SimApp(config, on_crash=on_crash)
