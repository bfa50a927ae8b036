"""Request bodies of the OpenAI-compatible API, parsed strictly from JSON.

Types are strict (no "4" -> 4, no true -> 1); unknown fields are ignored, as OpenAI's own
clients send optional fields this server does not use. Range checks (max_tokens >= 1,
temperature >= 0, 0 < top_p <= 1, ...) are left to SamplingParams so that offline and
served requests share one set of rules and messages.
"""
from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onespec.sampling_params import SamplingParams
from onespec.structured.params import StructuredOutputsParams
from onespec.serve.errors import APIError, validation_error

MAX_STOP_STRINGS = 64          # stop strings per request
MAX_STOP_STRING_CHARS = 1024   # characters per stop string
MAX_CACHE_SALT_CHARS = 1024
MAX_CHOICES = 128              # choices per request: prompts x n
MAX_LOGPROBS = 20              # top log-probabilities per token

# Fields whose union types give unreadable pydantic errors get a plain sentence instead.
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # usage on every chunk (vLLM's field)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str                      # JSON text, as OpenAI sends it


class ToolCallBody(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallBody] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                    # a tool's answer to a call
    name: str | None = None

    def as_template_dict(self) -> dict:
        """The message as chat templates take it (Hugging Face's convention: a call's
        arguments as an object when they are JSON)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


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
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    # logit processors (OpenAI's, and vLLM's repetition_penalty and min_tokens)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None       # prefix-cache namespace: only equal salts share
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

    def logprob_params(self) -> dict:
        """SamplingParams' logprobs and prompt_logprobs for this request."""
        return {}

    def continuous_usage(self) -> bool:
        return bool(self.include_usage() and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output length and the field that gave it."""
        if self.max_tokens is None and self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def num_decoded(self) -> int:
        """Samples decoded per prompt: best_of, of which the n likeliest are returned."""
        return max(self.num_samples, self.best_of or 0)

    def check_unsupported(self):
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise APIError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                           f"characters, got {len(self.cache_salt)}", param="cache_salt")
        if not 1 <= self.num_samples <= MAX_CHOICES:
            raise APIError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n}",
                           param="n")
        if self.best_of is not None:
            if not self.num_samples <= self.best_of <= MAX_CHOICES:
                raise APIError(f"best_of must be an integer in [n = {self.num_samples}, "
                               f"{MAX_CHOICES}], got {self.best_of}", param="best_of")
            if self.stream and self.best_of > self.num_samples:
                raise APIError("best_of > n is not supported with stream (the best are known "
                               "only at the end)", param="best_of")
        for key in self.logit_bias or {}:
            if not (key.isdigit() and len(key) < 19):
                raise APIError(f"logit_bias keys must be token ids (as strings), got {key!r}",
                               param="logit_bias")

    def sampling_params(self, default_max_tokens: int,
                        structured: StructuredOutputsParams | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """Builds SamplingParams; a ValueError (which names the field) becomes a 400.
        defaults: temperature, top_p, top_k for the fields the request leaves out (the
        model's generation config, admission.generation_defaults)."""
        max_tokens, max_tokens_field = self.requested_max_tokens()
        kwargs = dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                      ignore_eos=self.ignore_eos, structured_outputs=structured,
                      stop_token_ids=self.stop_token_ids or [], seed=self.seed,
                      **self.logprob_params())
        for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is None:
                value = (defaults or {}).get(name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            kwargs["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
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
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token-id list, or a list of them."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.echo_only:
            return 1, "max_tokens"           # one token is decoded, and dropped
        return super().requested_max_tokens()

    def logprob_params(self) -> dict:
        return {"logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echo else None}

    def check_unsupported(self):
        super().check_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                           f"{self.logprobs}", param="logprobs")
        if self.echo and self.stream:
            raise APIError("echo is not supported with stream", param="echo")
        if self.suffix:
            raise APIError("suffix needs a fill-in-the-middle model, which this server does "
                           "not serve", param="suffix")
        prompts = self.prompts()
        if not prompts:
            raise APIError("prompt must not be an empty list", param="prompt")
        if len(prompts) * self.num_decoded > MAX_CHOICES:
            raise APIError(f"a request may ask for at most {MAX_CHOICES} samples (prompts x "
                           f"best_of or n), got {len(prompts)} x {self.num_decoded}",
                           param="prompt")


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True

    def logprob_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def effective_tool_choice(self):
        """"none", "auto", "required" or {"type": "function", "function": {"name"}}; with
        tools given and no tool_choice, "auto" (OpenAI's default)."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def check_unsupported(self):
        super().check_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                               f"{self.top_logprobs}", param="top_logprobs")
        if not self.messages:
            raise APIError("messages must be a non-empty list", param="messages")
        choice = self.effective_tool_choice()
        names = [t.function.name for t in self.tools or []]
        if choice != "none" and not names:
            raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or name not in names:
                raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": NAME}} "
                               f"naming one of the tools {names}", param="tool_choice")
        if len(set(names)) != len(names):
            raise APIError("tools must have distinct function names", param="tools")


def parse_body(model: type[_Strict], body: bytes) -> _Strict:
    """Validates a raw JSON body; any problem becomes one 400 APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    req.check_unsupported()
    return req


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered by the template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_unsupported(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape): token ids back to text."""
    model: str | None = None
    tokens: list[int]

    def check_unsupported(self):
        pass
