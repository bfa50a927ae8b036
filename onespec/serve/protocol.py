"""Request bodies of the OpenAI-compatible API, parsed strictly from JSON.

Types are strict (no "4" -> 4, no true -> 1); unknown fields are ignored, as OpenAI's own
clients send optional fields this server does not use. Range checks (max_tokens >= 1,
temperature >= 0, 0 < top_p <= 1, ...) are left to SamplingParams so that offline and
served requests share one set of rules and messages.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onespec.sampling_params import SamplingParams
from onespec.structured.params import StructuredOutputsParams
from onespec.serve.errors import APIError, validation_error

MAX_STOP_STRINGS = 64          # stop strings per request
MAX_STOP_STRING_CHARS = 1024   # characters per stop string

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


class JSONSchemaFormat(_Strict):
    name: str
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None          # the schema is always enforced exactly
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def fields(self) -> dict:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar, "json_object": self.json_object}
        return {k: v for k, v in given.items() if v is not None}


GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


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
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint and the field that gave it (APIError 400 if malformed)."""
        sources = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError("response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            sources.append(("response_format.json_schema.schema",
                            {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", self.structured_outputs.fields()))
        for alias, kind in GUIDED_ALIASES.items():
            if getattr(self, alias) is not None:
                sources.append((alias, {kind: getattr(self, alias)}))
        if not sources:
            return None, ""
        if len(sources) > 1:
            names = [name.split(".")[0] for name, _ in sources]
            raise APIError(f"give at most one of response_format, structured_outputs and the "
                           f"guided_* fields, got {', '.join(names)}", param=names[1])
        field, kwargs = sources[0]
        try:
            return StructuredOutputsParams(**kwargs), field
        except ValueError as e:
            message = str(e)
            if field != "structured_outputs":       # name the field the client used
                message = message.replace("structured_outputs must set exactly one of "
                                          "json, regex, choice, grammar or json_object",
                                          f"{field} must not be empty")
                message = re.sub(r"^structured_outputs\.\w+", field, message)
            raise APIError(message, param=field.split(".")[0]) from None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise APIError("stop strings must be non-empty", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                           param="stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise APIError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters "
                           f"long, got one of {longest}", param="stop")
        return stop

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output length and the field that gave it."""
        return self.max_tokens, "max_tokens"

    def check_unsupported(self):
        if self.n is not None and self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", param="n")
        if self.n is not None and self.n > 1:
            raise APIError("n > 1 is not supported", param="n")

    def sampling_params(self, default_max_tokens: int,
                        structured: StructuredOutputsParams | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """Builds SamplingParams; a ValueError (which names the field) becomes a 400.
        defaults: temperature, top_p, top_k for the fields the request leaves out (the
        model's generation config, serving.generation_defaults)."""
        max_tokens, max_tokens_field = self.requested_max_tokens()
        kwargs = dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                      ignore_eos=self.ignore_eos, structured_outputs=structured,
                      stop_token_ids=self.stop_token_ids or [], seed=self.seed)
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is None:
                value = (defaults or {}).get(name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e)
            param = message.split(" ", 1)[0]
            if param == "max_tokens":          # it may have come as max_completion_tokens
                message = max_tokens_field + message[len(param):]
                param = max_tokens_field
            raise APIError(message, param=param) from None


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

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def parse_body(model: type[_Strict], body: bytes) -> _Strict:
    """Validates a raw JSON body; any problem becomes one 400 APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    req.check_unsupported()
    return req

