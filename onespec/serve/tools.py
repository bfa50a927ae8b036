"""Tool calling on /v1/chat/completions.

Two ways a reply becomes tool calls:
  - forced (`tool_choice` "required" or a named function): the output is constrained by a
    JSON schema built from the tools' parameters (structured outputs), so it always parses,
    drafts on, with no parser flag: a named function's output is its arguments object;
    "required" outputs a JSON array of {"name", "parameters"} calls (one call unless
    parallel_tool_calls), as vLLM does.
  - auto (`tool_choice` "auto", the default when tools are given): the model writes freely
    and the server's parser (`--tool-call-parser`, with `--enable-auto-tool-choice`) finds
    the calls in the model's own format: text before the first call is the content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str                     # JSON text, as OpenAI sends it

    def as_dict(self, index: int) -> dict:
        return {"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolParseError(ValueError):
    """The model's output did not hold the tool calls its format promised."""


def _call(obj, names: set[str] | None, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolParseError(f"a tool call must be an object with a 'name', got {obj!r}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if names is not None and obj["name"] not in names:
        raise ToolParseError(f"the model called {obj['name']!r}, which is not among the tools")
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


# ---- forced calls: the schema, and reading the constrained output -------------------------
def forced_schema(tools: list[dict], choice, parallel: bool) -> dict:
    """The JSON schema the output must follow for tool_choice `choice` ("required" or
    {"type": "function", "function": {"name": ...}})."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def read_forced(text: str, choice) -> list[ToolCall]:
    """The calls in the constrained output of a forced tool choice."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:      # cut short by max_tokens
        raise ToolParseError(f"the output is not complete JSON ({e})") from None
    if isinstance(choice, dict):
        return [ToolCall(choice["function"]["name"], json.dumps(value))]
    return [_call(c, None, "parameters") for c in value]


# ---- auto calls: the parsers ---------------------------------------------------------------
class ToolParser:
    """Finds tool calls in free output. `marker`: the text that starts the first call
    (a stream sends content until it may begin)."""
    marker = ""

    def start(self, text: str) -> int | None:
        """Where the first call begins in text, or None if none (yet)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        start = self.start(text)
        if start is None:
            return text, []
        content = text[:start].strip() or None
        return content, self.calls(text[start:], names)

    def calls(self, text: str, names: set[str]) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def calls(self, text, names):
        return [_call(_json(body), names, "arguments") for body in self._CALL.findall(text)]


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`."""
    marker = "<|python_tag|>"

    def start(self, text):
        stripped = text.lstrip()
        if stripped.startswith(self.marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def calls(self, text, names):
        body = text.strip().removeprefix(self.marker).strip()
        decoder, out, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError as e:
                raise ToolParseError(f"not a JSON tool call: {e}") from None
            out.append(_call(obj, names, "parameters"))
            i = len(body) - len(body[i:].lstrip().lstrip(";").lstrip())
        return out


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""
    marker = "[TOOL_CALLS]"

    def calls(self, text, names):
        value = _json(text.removeprefix(self.marker).strip())
        return [_call(c, names, "arguments") for c in (value if isinstance(value, list)
                                                        else [value])]


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolParseError(f"not a JSON tool call: {e}") from None


def tool_parser(name: str) -> ToolParser:
    parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
               "mistral": MistralParser}
    if name not in parsers:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return parsers[name]()


def held_back(text: str, parser: ToolParser) -> int:
    """How much of the end of text a stream must hold back: it may still begin a call."""
    if isinstance(parser, Llama3JsonParser):
        return len(text) if not text.strip() else 0
    marker = parser.marker
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolMode:
    """How one chat request's output becomes tool calls: forced (parser None: the output is
    constrained JSON) or auto (a parser reads the model's own format)."""
    choice: str | dict
    tools: list[dict]
    parser: ToolParser | None = None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def result(self, text: str, finish_reason: str | None):
        """(content, calls, finish_reason) of a finished output; output that does not parse
        (cut short by max_tokens, say) stays content."""
        try:
            if self.parser is None:
                content, calls = None, read_forced(text, self.choice)
            else:
                content, calls = self.parser.parse(text, self.names)
        except ToolParseError:
            return text, [], finish_reason
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def visible(self, text: str) -> str:
        """The part of an unfinished output a stream may send as content now."""
        if self.parser is None:
            return ""
        start = self.parser.start(text)
        if start is not None:
            return text[:start]
        return text[:len(text) - held_back(text, self.parser)]
