"""Request bodies of the HTTP APIs, validated strictly: unknown fields are refused with a 400
that names them (a typo such as ``max_token`` must not be silently ignored), and types are not
coerced (``"stream": "yes"``, ``"echo": 0`` or ``"input_ids": [false]`` are errors). Every
bound a handler enforces is in the schema, so the OpenAPI document says what is accepted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adaflash.config import Policy

INT64 = 2**63  # seeds are 64-bit integers (torch.Generator)
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: top-k off
StopString = Annotated[str, Field(min_length=1, max_length=256)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""

    error: ErrorBody


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What the generation routes answer besides 200 (streams: text/event-stream, SSE)
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    400: _error("invalid request: a malformed or schema-invalid body, or a value beyond a limit"),
    404: _error("unknown model"),
    413: _error("body over the size limit"),
    499: _error("the client went away before the answer was complete"),
    500: _error("the engine failed while serving this request (other requests go on)"),
}
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("invalid request"),
    401: _error("missing or wrong bearer token"),
    403: _error("the admin API is disabled (no admin token configured)"),
    409: _error("the version cannot be used"),
    413: _error("body over the size limit"),
}


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
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)  # extension (vLLM/SGLang)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: StopString | list[StopString] | None = Field(default=None, max_length=4)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    ignore_eos: bool = False  # extension, for benchmarks
    domain: str | None = Field(default=None, max_length=32)  # extension: workload tag

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] = Field(min_length=1)
    echo: bool = Field(default=False, description="not supported; must be false")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class SGLangSamplingParams(Strict):
    """Left out: temperature, top_p and top_k come from the server's defaults (the model's
    ``generation_config.json``, see ``/get_model_info``), as SGLang does."""

    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # SGLang: -1 = off
    max_new_tokens: int = Field(default=128, ge=1)
    stop: StopString | list[StopString] | None = Field(default=None, max_length=16)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, alias="sampling_seed", ge=-INT64, lt=INT64)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class GenerateRequest(Strict):
    text: str | None = None
    input_ids: list[TokenId] | None = None
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
