"""Tool-call parsers on model outputs written in each format (worked examples), the schema
of forced tool choices, and what a stream may send before a call is certain."""
from __future__ import annotations

import json

import pytest

from onespec.serve.tools import (ToolMode, ToolParseError, forced_schema, held_back,
                                 read_forced, tool_parser)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "g"}}]
NAMES = {"f", "g"}


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     "Let me check.", [("f", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     None, [("f", {"x": 1}), ("g", {})]),
    ("hermes", "no call here", "no call here", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 2}}', None, [("f", {"x": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; '
                    '{"name": "g", "parameters": {}}', None, [("f", {"x": 2}), ("g", {})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 3}}]', None, [("f", {"x": 3})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "g", "arguments": {}}]', "Sure.", [("g", {})]),
])
def test_parsers_read_their_format(parser, text, content, calls):
    got_content, got = tool_parser(parser).parse(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_unknown_functions_and_broken_json_stay_content():
    mode = ToolMode("auto", TOOLS, tool_parser("hermes"))
    for text in ('<tool_call>{"name": "h", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "argum'):
        assert mode.result(text, "stop") == (text, [], "stop")
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        tool_parser("pythonic")


def test_forced_schemas_and_their_output():
    named = {"type": "function", "function": {"name": "f"}}
    assert forced_schema(TOOLS, named, True) == TOOLS[0]["function"]["parameters"]
    required = forced_schema(TOOLS, "required", parallel=False)
    assert required["maxItems"] == 1 and required["minItems"] == 1
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == \
        [{"const": "f"}, {"const": "g"}]
    assert [(c.name, c.arguments) for c in read_forced('{"x": 5}', named)] == [("f", '{"x": 5}')]
    calls = read_forced('[{"name": "g", "parameters": {}}]', "required")
    assert [(c.name, c.arguments) for c in calls] == [("g", "{}")]
    with pytest.raises(ToolParseError):
        read_forced('[{"name": "g", "param', "required")
    mode = ToolMode("required", TOOLS)
    assert mode.result('[{"name": "g", "parameters": {}}]', "stop")[2] == "tool_calls"
    assert mode.result('[{"name": "g"', "length") == ('[{"name": "g"', [], "length")


def test_streams_hold_back_what_may_start_a_call():
    hermes = tool_parser("hermes")
    assert held_back("Sure <tool_", hermes) == len("<tool_")
    assert held_back("Sure <b>", hermes) == 0
    mode = ToolMode("auto", TOOLS, hermes)
    assert mode.visible("Sure <tool_") == "Sure "
    assert mode.visible('Sure <tool_call>{"na') == "Sure "
    llama = ToolMode("auto", TOOLS, tool_parser("llama3_json"))
    assert llama.visible("  ") == "" and llama.visible('{"name"') == ""
    assert llama.visible("It is") == "It is"
