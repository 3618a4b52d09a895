"""Request bodies of the HTTP APIs, validated strictly: unknown fields are refused with a 400
that names them (a typo such as ``max_token`` must not be silently ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adaflash.config import Policy


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class StreamOptions(Strict):
    include_usage: bool = False


class _Sampling(Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (vLLM/SGLang style)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    ignore_eos: bool = False  # extension, for benchmarks
    domain: str | None = Field(default=None, max_length=32)  # extension: workload tag

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = Field(default=False, description="not supported; must be false")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class SGLangSamplingParams(Strict):
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # SGLang: -1 = off
    max_new_tokens: int = Field(default=128, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, alias="sampling_seed")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class GenerateRequest(Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    stream: bool = False
    rid: str | None = Field(default=None, max_length=96)
    domain: str | None = Field(default=None, max_length=32)


class PromoteRequest(Strict):
    version: str
    reason: str | None = None


class RollbackRequest(Strict):
    version: str | None = None


class ConfigRequest(Strict):
    policy: Policy | None = None
    gamma: float | None = Field(default=None, gt=0.0, le=4.0)
