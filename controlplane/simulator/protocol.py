"""OpenAI request bodies the simulator accepts; unknown fields are ignored, as vLLM does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "RerankRequest",
    "ResponsesRequest",
    "ScoreRequest",
    "StreamOptions",
    "TokenizeRequest",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    ignore_eos: bool | None = False
    user: str | None = None

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_means_unset(cls, value: object, info: Any) -> object:  # vLLM types both `X | None`
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list) and len(p) != 1:
            raise ValueError("prompt: the simulator serves one prompt per request; send a string")
        if isinstance(p, list) and not p:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return [int(x) for x in p if isinstance(x, int)]


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="after")
    def _non_empty(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(i, int) for i in x):
            return [[int(i) for i in x if isinstance(i, int)]]
        return [i if isinstance(i, str) else list(i) for i in x if isinstance(i, str | list)]


class ResponsesRequest(_Body):
    """``POST /v1/responses``: the fields the simulator answers from."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = False

    @property
    def text(self) -> str:
        """The input as one prompt: instructions, then each item's text content."""
        parts = [self.instructions] if self.instructions else []
        if isinstance(self.input, str):
            return "\n".join([*parts, self.input])
        for item in self.input:
            content = item.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [str(c.get("text", "")) for c in content if isinstance(c, dict)]
        return "\n".join(parts)


class RerankRequest(_Body):
    """``POST /v1/rerank`` and ``/rerank`` (vLLM's Jina/Cohere-style rerank)."""

    model: str = Field(min_length=1)
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)


class ScoreRequest(_Body):
    """``POST /v1/score`` and ``/score``: one text against one or many, or pairs."""

    model: str = Field(min_length=1)
    text_1: str | list[str]
    text_2: str | list[str]


class TokenizeRequest(_Body):
    """``POST /tokenize``: a prompt or chat messages."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str = Field(min_length=1)
    tokens: list[int]
