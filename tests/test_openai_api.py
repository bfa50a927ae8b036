"""The OpenAI API as clients use it, driven by the official openai client against a real
`python -m onespec serve` over the demo pair (EAGLE-3, K = 3): prompt lists and `n` (choices
indexed prompt-major, streamed with their index, seeds derived per sample, samples sharing
their prompt's KV through the prefix cache), max_completion_tokens on completions,
continuous usage in streams, /tokenize and /detokenize. (Fields that would change the output
and are not implemented answer 400: tests/test_serve.py, BAD_REQUESTS.)"""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import Server  # noqa: E402
from onespec.demo import HEAD_DIR, TARGET_DIR  # noqa: E402

NAME = "demo"
PROMPTS = ["def mean(xs):\n", "import json\n\n\ndef load(path):\n"]
# two blocks and more of prompt, so that a sample's prompt KV can come from the cache
LONG_PROMPT = "class Config:\n    def __init__(self, path):\n        self.path = path\n" * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--model", TARGET_DIR, "--draft", HEAD_DIR, "--k", "3", "--max-batch-size", "8",
                "--served-model-name", NAME], tmp_path_factory.mktemp("openai-api") / "s.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def one(client, prompt, **kw) -> str:
    return client.completions.create(model=NAME, prompt=prompt, **{"max_tokens": 12, **kw}
                                     ).choices[0].text


def test_prompt_lists_answer_prompt_major(server, client):
    ids = server.post("/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [one(client, p, temperature=0) for p in PROMPTS]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    by_ids = client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=12,
                                       temperature=0)
    assert [c.text for c in by_ids.choices] == [alone[1], alone[1]]
    singles = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
               .usage for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)  # once per prompt
    assert r.usage.completion_tokens == 2 * sum(u.completion_tokens for u in singles)


def test_n_samples_use_seed_plus_index_and_share_the_prompt_kv(server, client):
    before = server.metrics()["onespec_prefix_cache_hits_total"]
    r = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=16, n=3,
                                  temperature=0.9, seed=41)
    hits = server.metrics()["onespec_prefix_cache_hits_total"] - before
    assert hits >= 2 * 32, hits          # samples 1 and 2 found the prompt's blocks cached
    texts = [c.text for c in r.choices]
    for s in range(3):
        assert texts[s] == one(client, LONG_PROMPT, max_tokens=16, temperature=0.9,
                               seed=41 + s)
    assert len(set(texts)) > 1


def test_streams_carry_each_choice_index(client):
    chunks = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, n=2,
                                       temperature=0.8, seed=3, stream=True)
    streamed, finished = defaultdict(str), {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    whole = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, n=2,
                                      temperature=0.8, seed=3)
    assert dict(streamed) == {c.index: c.text for c in whole.choices}
    assert set(finished) == {0, 1, 2, 3}
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Sort a list."}], max_tokens=8, n=2,
        temperature=0.8, seed=5, stream=True)
    roles, text = {}, defaultdict(str)
    for c in chat:
        for choice in c.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            text[choice.index] += choice.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"} and set(text) == {0, 1}


def test_max_completion_tokens_on_completions(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], temperature=0,
                                  extra_body={"max_completion_tokens": 5, "ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted and all(u is not None for u in counted)
    assert counted == sorted(counted) and counted[-1] == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_tokenize_and_detokenize(server, client):
    messages = [{"role": "user", "content": "Reverse a string."}]
    r = server.post("/tokenize", json={"model": NAME, "messages": messages})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens == len(r.json()["tokens"])
    t = server.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert t["max_model_len"] == 2048
    d = server.post("/detokenize", json={"model": NAME, "tokens": t["tokens"]}).json()
    assert d["prompt"] == PROMPTS[1]
    bad = server.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = server.post("/tokenize", json={"prompt": "x", "messages": messages})
    assert both.status_code == 400


# ---- tool calls ----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def check_call(call, tools=TOOLS):
    import jsonschema
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_required_tool_choice_always_gives_a_call_without_a_parser(client):
    pytest.importorskip("xgrammar")
    for seed in range(3):
        r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=80,
                                           temperature=1.0, seed=seed,
                                           parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_named_tool_choice_calls_that_function(client):
    pytest.importorskip("xgrammar")
    r = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and r.choices[0].finish_reason == "tool_calls"
    check_call(call)


def test_streamed_tool_calls_arrive_as_deltas(client):
    pytest.importorskip("xgrammar")
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
              temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, reasons, content = [], [], ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and content == ""
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert [c.index for c in calls] == list(range(len(calls)))


def test_auto_tool_choice_without_a_parser_is_a_400(client):
    for kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS,
                                           max_tokens=4, **kw)
    with pytest.raises(openai.BadRequestError, match="naming one of the tools"):
        client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_tool_history_is_rendered_by_the_template(server, client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = server.post("/tokenize", json={"messages": history}).json()["tokens"]
    text = server.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' \
           '</tool_call>' in text and "# tool result: sunny, 21 C" in text
    r = client.chat.completions.create(model=NAME, messages=history, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_with_a_parser_answers_content(tmp_path):
    """In-process server with the hermes parser: the demo model answers text (it was never
    taught to call tools), which comes back as content with no calls."""
    from fastapi.testclient import TestClient

    from onespec import LLM
    from onespec.serve.app import create_app
    llm = LLM(TARGET_DIR, dtype="float32", device="cpu", max_batch_size=2)
    try:
        with TestClient(create_app(llm, NAME, tool_call_parser="hermes")) as http:
            c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
            r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=8,
                                          temperature=0)
            assert r.choices[0].message.tool_calls is None
            assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    finally:
        llm.close()


# ---- logit processors ----------------------------------------------------------------------
def test_logit_processors_through_the_client_equal_offline_decoding(server, client):
    """logit_bias banning the token greedy decoding picks, penalties and min_tokens, sent by
    the openai client to the speculating server, give offline plain decoding's tokens."""
    from onespec import LLM, SamplingParams
    prompt = PROMPTS[0]
    free = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    banned = free.choices[0].token_ids[0]
    fields = dict(logit_bias={str(banned): -100}, presence_penalty=0.5, frequency_penalty=0.8)
    extra = dict(repetition_penalty=1.2, min_tokens=4, return_token_ids=True)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body=extra, **fields)
    offline = LLM(TARGET_DIR, dtype="float32", device="cpu", max_batch_size=2)
    try:
        sp = SamplingParams(max_tokens=16, logit_bias={banned: -100.0}, presence_penalty=0.5,
                            frequency_penalty=0.8, repetition_penalty=1.2, min_tokens=4)
        expected = offline.generate(prompt, sp)[0].outputs[0].token_ids
    finally:
        offline.close()
    assert r.choices[0].token_ids == expected and banned not in expected
    assert r.model_extra["onespec"]["num_draft_tokens"] > 0         # it did speculate


# ---- log-probabilities ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline():
    from onespec import LLM
    llm = LLM(TARGET_DIR, dtype="float32", device="cpu", max_batch_size=2)
    yield llm
    llm.close()


def test_completion_logprobs_equal_offline_plain_decoding(client, offline):
    from onespec import SamplingParams
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    plain = offline.generate(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True,
                                                        logprobs=3))[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(plain.token_ids) == 12
    for got, top, token, entry in zip(lp.token_logprobs, lp.top_logprobs, plain.token_ids,
                                      plain.logprobs):
        assert abs(got - entry[token].logprob) < 1e-4
        assert 3 <= len(top) <= 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_max_tokens_0_scores_the_prompt(client, offline):
    """What lm-eval's loglikelihood tasks send: the prompt's tokens' logprobs, nothing more."""
    from onespec import SamplingParams
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPTS[1] and r.usage.completion_tokens == 0
    plain = offline.generate(PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    ids = plain.prompt_token_ids
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(ids) == r.usage.prompt_tokens
    for got, token, entry in zip(choice.logprobs.token_logprobs[1:], ids[1:],
                                 plain.prompt_logprobs[1:]):
        assert abs(got - entry[token].logprob) < 1e-4


def test_chat_logprobs_and_streamed_logprobs(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Sum a list."}], max_tokens=10,
              temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 10
    for entry in whole:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) for ch in c.choices
                if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in whole]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**{**kw, "logprobs": False})


def test_best_of_returns_the_likeliest_samples(client):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=1.0)
    samples = []
    for s in range(4):
        r = client.completions.create(**kw, seed=7 + s, logprobs=0)
        samples.append((sum(r.choices[0].logprobs.token_logprobs), r.choices[0].text))
    best = client.completions.create(**kw, seed=7, n=2, best_of=4)
    expected = [text for _, text in sorted(samples, reverse=True)[:2]]
    assert [c.text for c in best.choices] == expected
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(
        len(client.completions.create(**kw, seed=7 + s, extra_body={"return_token_ids": True})
            .choices[0].token_ids) for s in range(4))
    with pytest.raises(openai.BadRequestError, match="best_of must be an integer in"):
        client.completions.create(**kw, n=3, best_of=2)
