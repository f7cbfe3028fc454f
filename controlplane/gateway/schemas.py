"""OpenAI request bodies the gateway validates (strict types; unknown fields pass through to the replica)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = [
    "AudioRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "EmbeddingRequest",
    "ErrorDetail",
    "ErrorResponse",
    "FunctionDefinition",
    "ModelCard",
    "ModelList",
    "PassThroughRequest",
    "ResponseFormat",
    "ResponsesRequest",
    "StreamOptions",
    "Tool",
    "openapi_document",
]

# Token ids or strings: the four prompt shapes OpenAI accepts.
PromptT = str | list[str] | list[int] | list[list[int]]


class _Strict(BaseModel):
    # strict: "5" is not an int and "true" is not a bool, as with OpenAI's own API; extra fields are the
    # engine's sampling options, forwarded untouched (the original bytes go upstream, not a re-serialisation).
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Generation(_Strict):
    model: str = Field(min_length=1, max_length=256)
    """A served model name or a LoRA adapter name."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)

    @field_validator("stream", "n", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: object, info: Any) -> object:
        # OpenAI and vLLM read an explicit null as "not given"; the SDKs send it for unset options.
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    user: str | None = Field(default=None, max_length=256)


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: PromptT
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class ContentPart(_Strict):
    type: str = Field(min_length=1, max_length=64)
    text: str | None = None


# The roles OpenAI's Chat Completions API accepts; any other is its 400, not the replica's guess.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Strict):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


# A function name as OpenAI accepts it: letters, digits, underscores and dashes, at most 64.
_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema object."""
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type 'object'")
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = Field(default=None, max_length=64)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = Field(default=None, max_length=64)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: object, info: ValidationInfo) -> object:
        # OpenAI's 400s: a choice of tools without any, or a forced function that was not offered.
        tools: list[Tool] | None = info.data.get("tools")
        if choice is not None and choice != "none" and not tools:
            raise ValueError("'tool_choice' is set but no 'tools' are given")
        offered = {t.function.name for t in tools or ()}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in offered:
            raise ValueError(f"the function '{choice.function.name}' is not one of 'tools'")
        return choice


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1, max_length=256)
    input: PromptT
    encoding_format: str | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


class PassThroughRequest(_Strict):
    """A body routed by its ``model`` and forwarded untouched: ``/v1/rerank``, ``/v1/score``, ``/rerank``,
    ``/score``, ``/tokenize``, ``/detokenize``. The engine validates the rest."""

    model: str = Field(min_length=1, max_length=256)
    stream: bool | None = None


class ResponsesRequest(PassThroughRequest):
    """``POST /v1/responses``: as :class:`PassThroughRequest`, and it generates up to
    ``max_output_tokens``."""

    max_output_tokens: int | None = Field(default=None, ge=1)


class AudioRequest(PassThroughRequest):
    """``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: the two form fields of the
    ``multipart/form-data`` body the gateway reads; the audio file goes upstream unread."""


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "sarv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI 3.1 document, built from the models above (served at ``/openapi.json``)."""
    from pydantic.json_schema import models_json_schema

    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        EmbeddingRequest,
        PassThroughRequest,
        ResponsesRequest,
        ModelList,
        ErrorResponse,
    ]
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas = top.get("$defs", {})

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    errors = {
        str(code): {
            "description": text,
            "content": {"application/json": {"schema": ref("ErrorResponse")}},
        }
        for code, text in (
            (400, "invalid request"),
            (401, "missing or unknown API key"),
            (403, "model not allowed for this key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "rate limited"),
            (503, "no replica or queue full"),
        )
    }

    def post(schema: str, summary: str, media: str = "application/json") -> dict[str, Any]:
        body: dict[str, Any] = ref(schema)
        if media != "application/json":  # the audio form: the two fields the gateway reads
            body = {
                "type": "object",
                "required": ["model", "file"],
                "properties": {
                    "model": {"type": "string", "minLength": 1, "maxLength": 256},
                    "file": {"type": "string", "format": "binary"},
                },
            }
        return {
            "post": {
                "summary": summary,
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": {media: {"schema": body}}},
                "responses": {
                    "200": {
                        "description": "the replica's answer (JSON, or SSE when stream is true)",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **errors,
                },
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "Sarv gateway", "version": "1"},
        "paths": {
            "/v1/models": {
                "get": {
                    "summary": "Models and LoRA adapters served by ready replicas",
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "model list",
                            "content": {"application/json": {"schema": ref("ModelList")}},
                        },
                        "401": errors["401"],
                    },
                }
            },
            "/v1/completions": post("CompletionRequest", "Text completion"),
            "/v1/chat/completions": post("ChatCompletionRequest", "Chat completion"),
            "/v1/embeddings": post("EmbeddingRequest", "Embeddings"),
            "/v1/responses": post("ResponsesRequest", "Responses API (passed through)"),
            **{
                path: post("PassThroughRequest", f"{path} (passed through)")
                for path in ("/v1/rerank", "/v1/score", "/rerank", "/score", "/tokenize", "/detokenize")
            },
            "/v1/audio/transcriptions": post(
                "AudioRequest", "Transcription (passed through)", "multipart/form-data"
            ),
            "/v1/audio/translations": post(
                "AudioRequest", "Translation (passed through)", "multipart/form-data"
            ),
            "/health": {"get": {"summary": "alive", "responses": {"200": {"description": "alive"}}}},
            "/ready": {
                "get": {
                    "summary": "has a store and a ready replica",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
