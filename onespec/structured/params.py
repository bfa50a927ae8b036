"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's shape)."""
from __future__ import annotations

import json
from dataclasses import dataclass

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of:

    json         a JSON schema, as a dict or as JSON text: the output is one JSON value
                 that validates against it
    regex        a regular expression the whole output matches
    choice       a non-empty list of non-empty strings: the output is one of them
    grammar      an EBNF grammar (xgrammar / GBNF syntax, start rule `root`)
    json_object  True: the output is any JSON object

    JSON is compact: no whitespace between tokens (separators "," and ":").
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be True or False, "
                             f"got {self.json_object!r}")
        given = [f for f in FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar or json_object, got {given or 'none'}")
        if self.json is not None:
            self.json = _schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(f for f in FIELDS if getattr(self, f) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _schema(value) -> dict:
    """A JSON schema from a dict or JSON text (an object either way)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if isinstance(value, bool):     # true / false are schemas too, but say nothing useful
        raise ValueError("structured_outputs.json must be a JSON schema object, got a boolean")
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object (a dict or its "
                         f"JSON text), got {type(value).__name__}")
    for ref in _refs(value):
        if not ref.startswith("#"):     # the compiler would leave it unconstrained
            raise ValueError(f"structured_outputs.json has \"$ref\": {ref[:200]!r}, which "
                             "points outside the schema; only references into it (\"#/...\") "
                             "are supported, and nothing is fetched")
    return value


def _walk(node):
    """Every dict and list inside a JSON value, iteratively (schemas can nest deeply)."""
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        children = node.values() if isinstance(node, dict) else node \
            if isinstance(node, list) else ()
        stack.extend(c for c in children if isinstance(c, (dict, list)))


def _refs(schema: dict):
    for node in _walk(schema):
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            yield node["$ref"]


def spec_size(params: StructuredOutputsParams) -> tuple[int, int]:
    """(characters of the spec's canonical text, enumerated alternatives: `enum` entries of
    a schema, or choices): what admission limits, as they drive compile time and memory."""
    kind, text = params.key()
    if kind == "json":
        alternatives = sum(len(n["enum"]) for n in _walk(params.json)
                           if isinstance(n, dict) and isinstance(n.get("enum"), list))
    else:
        alternatives = len(params.choice) if kind == "choice" else 0
    return len(text), alternatives
