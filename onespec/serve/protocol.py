"""Request bodies of the OpenAI-compatible API, parsed strictly from JSON.

Types are strict (no "4" -> 4, no true -> 1); unknown fields are ignored, as OpenAI's own
clients send optional fields this server does not use. Range checks (max_tokens >= 1,
temperature >= 0, 0 < top_p <= 1, ...) are left to SamplingParams so that offline and
served requests share one set of rules and messages.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from onespec.sampling_params import SamplingParams
from onespec.serve.errors import APIError, validation_error

# Fields whose union types give unreadable pydantic errors get a plain sentence instead.
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise APIError("stop strings must be non-empty", param="stop")
        return stop

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_unsupported(self):
        if self.n is not None and self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", param="n")
        if self.n is not None and self.n > 1:
            raise APIError("n > 1 is not supported", param="n")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Builds SamplingParams; a ValueError (which names the field) becomes a 400."""
        max_tokens = self.requested_max_tokens()
        kwargs = dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                      ignore_eos=self.ignore_eos,
                      stop_token_ids=self.stop_token_ids or [], seed=self.seed)
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None

    def check_unsupported(self):
        super().check_unsupported()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.logprobs is not None:
            raise APIError("logprobs are not supported", param="logprobs")


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False

    def check_unsupported(self):
        super().check_unsupported()
        if self.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        if not self.messages:
            raise APIError("messages must be a non-empty list", param="messages")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


def parse_body(model: type[_Strict], body: bytes) -> _Strict:
    """Validates a raw JSON body; any problem becomes one 400 APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    req.check_unsupported()
    return req

