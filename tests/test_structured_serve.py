"""Structured outputs through the server: a real `python -m onespec serve` process over the
demo pair (EAGLE-3, K = 3), driven by the official openai client: response_format on both
endpoints, the structured_outputs field and the guided_* aliases, bad specs -> 400."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import assert_pool_full  # noqa: E402
from test_serve import CHAT_TEMPLATE, Server  # noqa: E402
from onespec import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from onespec.demo import HEAD_DIR, TARGET_DIR  # noqa: E402

NAME = "demo"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}},
    "required": ["name", "tags", "score"]}
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo target with a chat template (its files copied, the template added)."""
    path = tmp_path_factory.mktemp("demo-chat")
    for name in os.listdir(TARGET_DIR):
        if name != "tokenizer_config.json":
            shutil.copy(os.path.join(TARGET_DIR, name), path / name)
    with open(os.path.join(TARGET_DIR, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg,
                                                            "chat_template": CHAT_TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # a small batch keeps the KV pool (sized for max_batch_size full-length requests) small
    s = Server(["--model", model_dir, "--draft", HEAD_DIR, "--k", "3", "--max-batch-size", "8",
                "--served-model-name", NAME], tmp_path_factory.mktemp("logs") / "server.log")
    try:
        # loads while the server starts
        offline = LLM(model_dir, device="cpu", dtype="float32", max_batch_size=8)
        yield s.wait_ready(), offline
    finally:
        s.stop()


def test_chat_json_schema_matches_offline(server):
    srv, offline = server
    r = srv.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 tokenize=False)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    sp = SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert offline.generate(ids, sp)[0].outputs[0].text == choice.message.content
    assert_pool_full(offline)


@pytest.mark.parametrize("extra,check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=\d\d?", t)),
])
def test_completion_fields_and_aliases(server, extra, check):
    srv, _ = server
    client = srv.client()
    r = client.completions.create(model=NAME, prompt="value = ", max_tokens=60,
                                  temperature=0.8, seed=3, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert check(r.choices[0].text), r.choices[0].text
    chunks = client.completions.create(model=NAME, prompt="value = ", max_tokens=60,
                                       temperature=0.8, seed=3, extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", 'response_format.json_schema.schema is invalid: Unsupported type'),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
     "structured_outputs.regex is invalid: Regex parsing error"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar",
     "guided_grammar is invalid: EBNF parser error"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar or json_object"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "give at most one of response_format, structured_outputs and the guided_* fields"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format of type json_schema needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
])
def test_bad_specs_answer_400_and_the_server_keeps_serving(server, extra, param, message):
    srv, _ = server
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="x = ", max_tokens=8, extra_body=extra)
    body = err.value.body
    assert message in body["message"] and body["param"] == param, body
    r = client.completions.create(model=NAME, prompt="x = ", max_tokens=8,
                                  extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].text == "ok" and r.choices[0].finish_reason == "stop"
    h = srv.wait_pool_full()
    assert h["kv_blocks_free"] == h["kv_blocks_total"]
