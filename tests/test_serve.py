"""The OpenAI-compatible server, end to end: a real `python -m onespec serve` process on
127.0.0.1 over a tiny random Llama with a byte-level BPE tokenizer, driven by the official
openai client (and httpx for raw bodies). Greedy results must equal offline LLM.generate."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import assert_pool_full, make_eagle3_head, make_hf_model  # noqa: E402
from onespec import LLM, SamplingParams  # noqa: E402

VOCAB_SIZE = 300
API_KEY = "sk-onespec-test"
MODEL_NAME = "tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog. hello world! ",
          "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
          "import os, sys\nfor line in sys.stdin:\n    print(line.strip())\n"]
STARTUP_TIMEOUT_S = 90
# A tiny model gains nothing from intra-op threads, and on a busy 2-core machine their
# spinning makes each step tens of times slower: one thread in the servers and in here.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_tokenizer(path, vocab_size: int = VOCAB_SIZE, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer of exactly vocab_size tokens (3 specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target, draft = root / MODEL_NAME, root / "eagle3-head"
    hf = make_hf_model(target, "llama", vocab_size=VOCAB_SIZE)
    write_tokenizer(target)
    make_eagle3_head(draft, hf)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def offline(model_dirs):
    return LLM(model_dirs[0], device="cpu", dtype="float32")


# ---- server processes ------------------------------------------------------------------
class Server:
    def __init__(self, args: list[str], log_path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onespec", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
             "--api-key", API_KEY, "--no-access-log", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})

    def wait_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return open(self.log_path).read()[-5000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, **{"timeout": 30, **kw})

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_pool_full(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["kv_blocks_free"] == h["kv_blocks_total"] or time.monotonic() > deadline:
                return h
            time.sleep(0.05)


@pytest.fixture(scope="module")
def launched(model_dirs, tmp_path_factory):
    """Both servers (plain, and with an EAGLE-3 head and the suffix-automaton enhancer)
    launched at once; always terminated."""
    target, draft = model_dirs
    logs = tmp_path_factory.mktemp("server-logs")
    started = []
    try:
        started.append(Server(["--model", target], logs / "plain.log"))
        started.append(Server(["--model", target, "--draft", draft, "--k", "3",
                               "--sa-enhancer", "2",
                               "--served-model-name", "tiny-eagle"], logs / "draft.log"))
        yield {"plain": started[0], "draft": started[1]}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def servers(launched, offline):
    """Ready servers; the offline reference LLM loads while they start."""
    for s in launched.values():
        s.wait_ready()
    return launched


@pytest.fixture(scope="module")
def server(servers):
    return servers["plain"]


def greedy(offline, prompts, max_tokens=24, **kw):
    sps = [SamplingParams(max_tokens=m, **kw) for m in
           (max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts))]
    return [o.outputs[0] for o in offline.generate(prompts, sps)]


def chat_prompt_ids(offline, messages):
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    return offline.tokenizer.encode(text, add_special_tokens=False)


# ---- results equal offline greedy --------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    h = server.health()
    assert h["status"] == "ok" and h["kv_blocks_free"] == h["kv_blocks_total"] > 0


def test_completion_matches_offline(server, offline):
    prompts = ["hello world", [5, 17, 42, 99, 7]]
    expected = greedy(offline, prompts, max_tokens=24)
    client = server.client()
    for prompt, exp in zip(prompts, expected):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                      temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == exp.token_ids
        assert choice.text == exp.text
        assert choice.finish_reason == exp.finish_reason
        assert r.object == "text_completion" and r.model == MODEL_NAME
        assert r.usage.completion_tokens == len(exp.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        spec = r.model_extra["onespec"]
        assert spec["target_steps"] == len(exp.token_ids) and spec["num_draft_tokens"] == 0


def test_chat_matches_offline(server, offline):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "def fib(n):"}]
    exp = greedy(offline, [chat_prompt_ids(offline, messages)], max_tokens=20)[0]
    r = server.client().chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.text
    assert r.choices[0].finish_reason == exp.finish_reason
    assert r.usage.prompt_tokens == len(chat_prompt_ids(offline, messages))


def test_streaming_matches_offline(server, offline):
    client = server.client()
    exp = greedy(offline, ["the quick brown fox"], max_tokens=40, ignore_eos=True)[0]
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="the quick brown fox", max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    messages = [{"role": "user", "content": "hello"}]
    exp = greedy(offline, [chat_prompt_ids(offline, messages)], max_tokens=30)[0]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                 max_tokens=30, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == exp.finish_reason
    assert chunks[-1].model_extra["onespec"]["target_steps"] >= 1


def _stop_string(text: str) -> tuple[str, int]:
    """A 2-character stop string first found at its index i >= 4 (no U+FFFD in it)."""
    for i in range(4, len(text) - 2):
        s = text[i:i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s, i
    pytest.skip("no usable stop string in the random model's output")


def test_stop_strings_and_stop_token_ids(server, offline):
    client = server.client()
    prompt = [11, 12, 13]
    full = greedy(offline, [prompt], max_tokens=40, ignore_eos=True)[0]
    stop, at = _stop_string(full.text)
    for stream in (False, True):
        args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                    stop=[stop, "never-seen"], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**args).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (full.text[:at], "stop")
    stop_id = full.token_ids[6]
    exp = greedy(offline, [prompt], max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])[0]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40,
                                  temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                              "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == exp.token_ids
    assert r.choices[0].finish_reason == "stop"


# ---- concurrency and aborts -------------------------------------------------------------
def test_64_concurrent_requests(server, offline):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 60))]
               for _ in range(64)]
    prompts[::5] = [CORPUS[i % 3][:rng.randint(5, 40)] for i in range(len(prompts[::5]))]
    max_tokens = [rng.randint(1, 16) for _ in prompts]
    expected = greedy(offline, prompts, max_tokens=max_tokens)
    client = server.client(timeout=120)

    def one(i):
        args = dict(model=MODEL_NAME, prompt=prompts[i], max_tokens=max_tokens[i],
                    temperature=0, extra_body={"return_token_ids": True})
        if i % 3:
            c = client.completions.create(**args).choices[0]
            return c.model_extra["token_ids"], c.text
        chunks = list(client.completions.create(stream=True, **args))
        ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])]
        return ids, "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(one, range(64)))
    for i, ((ids, text), exp) in enumerate(zip(results, expected)):
        assert ids == exp.token_ids, f"request {i}"
        assert text == exp.text, f"request {i}"
    h = server.wait_pool_full()
    assert h["kv_blocks_free"] == h["kv_blocks_total"]
    assert h["num_requests_running"] == h["num_requests_waiting"] == 0
    m = server.metrics()
    assert m["onespec_kv_blocks_free"] == m["onespec_kv_blocks_total"]


def _aborted(server) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items()
               if k.startswith("onespec_requests_total") and "finish_reason=abort" in k)


def test_dropped_stream_frees_blocks(server):
    before = _aborted(server)
    stream = server.client().completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=240, stream=True,
        extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    h = server.health()
    assert h["kv_blocks_free"] < h["kv_blocks_total"]     # the request holds blocks
    stream.close()
    h = server.wait_pool_full()
    assert h["kv_blocks_free"] == h["kv_blocks_total"]
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1


def test_cancelled_request_frees_blocks(server):
    """A non-stream request whose client goes away while it runs is aborted."""
    before = _aborted(server)

    async def post_then_cancel():
        auth = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 240,
                "ignore_eos": True}))
            deadline = time.monotonic() + 10
            while (await c.get("/health")).json()["num_requests_running"] == 0:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(post_then_cancel())
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1
    h = server.wait_pool_full()
    assert h["kv_blocks_free"] == h["kv_blocks_total"]


# ---- bad input ---------------------------------------------------------------------------
def _completion(**over):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **over}


def _chat(**over):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **over}


BAD_REQUESTS = [
    ("invalid json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("not an object", "/v1/completions", [1, 2], 400, None),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("max_tokens string", "/v1/completions", _completion(max_tokens="5"), 400, "max_tokens"),
    ("temperature string", "/v1/completions", _completion(temperature="hot"), 400,
     "temperature"),
    ("prompt float", "/v1/completions", _completion(prompt=3.5), 400, "prompt"),
    ("prompt mixed list", "/v1/completions", _completion(prompt=[1, "a"]), 400, "prompt"),
    ("messages string", "/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, 400,
     "messages"),
    ("stop int", "/v1/completions", _completion(stop=5), 400, "stop"),
    ("max_tokens 0", "/v1/completions", _completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens -3", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     400, "max_tokens"),
    ("temperature < 0", "/v1/completions", _completion(temperature=-0.5), 400, "temperature"),
    ("top_p 0", "/v1/completions", _completion(top_p=0.0), 400, "top_p"),
    ("top_p > 1", "/v1/completions", _completion(top_p=1.5), 400, "top_p"),
    ("n 129", "/v1/completions", _completion(n=129), 400, "n"),
    ("n 0", "/v1/completions", _completion(n=0), 400, "n"),
    ("best_of < n", "/v1/completions", _completion(n=3, best_of=2), 400, "best_of"),
    ("best_of streamed", "/v1/completions", _completion(best_of=2, stream=True), 400,
     "best_of"),
    ("logit_bias key", "/v1/completions", _completion(logit_bias={"x": -100}), 400,
     "logit_bias"),
    ("logit_bias value", "/v1/completions", _completion(logit_bias={"5": -101}), 400,
     "logit_bias"),
    ("logit_bias past vocab", "/v1/completions", _completion(logit_bias={"300": 1}), 400,
     "logit_bias"),
    ("presence_penalty", "/v1/completions", _completion(presence_penalty=2.5), 400,
     "presence_penalty"),
    ("frequency_penalty", "/v1/chat/completions", _chat(frequency_penalty=-3.0), 400,
     "frequency_penalty"),
    ("repetition_penalty", "/v1/completions", _completion(repetition_penalty=0), 400,
     "repetition_penalty"),
    ("min_tokens", "/v1/completions", _completion(min_tokens=-1), 400, "min_tokens"),
    ("suffix", "/v1/completions", _completion(suffix="}"), 400, "suffix"),
    ("logprobs 21", "/v1/completions", _completion(logprobs=21), 400, "logprobs"),
    ("echo streamed", "/v1/completions", _completion(echo=True, stream=True), 400, "echo"),
    ("top_logprobs alone", "/v1/chat/completions", _chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("empty prompt list", "/v1/completions", _completion(prompt=[]), 400, "prompt"),
    ("129 choices", "/v1/completions", _completion(prompt=["a"] * 65, n=2), 400, "prompt"),
    ("tools, auto, no parser", "/v1/chat/completions", _chat(tools=[{
        "type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tool_choice"),
    ("tool name", "/v1/chat/completions", _chat(tools=[{
        "type": "function", "function": {"name": "f g"}}], tool_choice="none"), 400, "tools"),
    ("prompt too long (ids)", "/v1/completions", _completion(prompt=[5] * 300), 400, "prompt"),
    ("prompt too long (text)", "/v1/completions", _completion(prompt="zq" * 400), 400,
     "prompt"),
    ("token id out of vocab", "/v1/completions", _completion(prompt=[5, VOCAB_SIZE]), 400,
     "prompt"),
    ("empty prompt", "/v1/completions", _completion(prompt=""), 400, "prompt"),
    ("empty stop string", "/v1/completions", _completion(stop=[""]), 400, "stop"),
    ("unknown model", "/v1/completions", _completion(model="gpt-4"), 404, "model"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_answers_error_and_server_keeps_serving(server, name, path, body, status,
                                                          param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.post(path, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if name == "n 129":
        assert err["message"] == "n must be an integer in [1, 128], got 129"
    ok = server.post("/v1/completions", json=_completion(max_tokens=1))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_api_key_and_client_errors(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/completions", json=_completion(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                      max_retries=0).models.list()
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices


# ---- speculative decoding ----------------------------------------------------------------
def test_draft_server_same_greedy_text_with_spec_metrics(servers, offline):
    draft = servers["draft"]
    client = draft.client()
    prompts = ["hello world", [5, 17, 42, 99, 7], "import os"]
    expected = greedy(offline, prompts, max_tokens=24, ignore_eos=True)

    def one(prompt):
        return client.completions.create(model="tiny-eagle", prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body={"ignore_eos": True,
                                                                    "return_token_ids": True})

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        responses = list(pool.map(one, prompts))
    for r, exp in zip(responses, expected):
        assert r.choices[0].model_extra["token_ids"] == exp.token_ids
        assert r.choices[0].text == exp.text
        spec = r.model_extra["onespec"]
        assert spec["num_draft_tokens"] > 0
        assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
        assert 0 <= spec["num_sa_accepted_draft_tokens"] <= spec["num_sa_draft_tokens"] \
            <= spec["num_draft_tokens"]
        assert spec["acceptance_length"] == pytest.approx(24 / spec["target_steps"])
    chunks = list(client.completions.create(model="tiny-eagle", prompt="hello world",
                                            max_tokens=24, stream=True, temperature=0,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected[0].text
    m = draft.metrics()
    assert m["onespec_draft_tokens_total"] > 0
    # the prompts' greedy continuations repeat themselves: the automaton proposes drafts
    assert m["onespec_sa_draft_tokens_total"] >= m["onespec_sa_accepted_draft_tokens_total"] > 0
    assert m["onespec_kv_blocks_free"] == m["onespec_kv_blocks_total"]


# ---- prefix caching ----------------------------------------------------------------------
@pytest.mark.parametrize("which", ["plain", "draft"])
def test_cached_tokens_reach_the_openai_client(servers, offline, which):
    """The same 40-token prompt twice: the second reuses two 16-token blocks (the last
    token always computed), reported in usage.prompt_tokens_details (also in the stream's
    usage chunk) and in /metrics; the text is unchanged."""
    srv = servers[which]
    name = MODEL_NAME if which == "plain" else "tiny-eagle"
    prompt = random.Random(which).sample(range(3, VOCAB_SIZE), 40)
    expected = greedy(offline, [prompt], max_tokens=8, ignore_eos=True)[0]
    before = srv.metrics()
    client = srv.client()
    first = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(
        model=name, prompt=prompt, max_tokens=8, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.prompt_tokens == 40
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    assert first.choices[0].text == expected.text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    srv.wait_pool_full()
    after = srv.metrics()
    grew = {key: after[key] - before.get(key, 0.0) for key in
            ("onespec_prefix_cache_queries_total", "onespec_prefix_cache_hits_total")}
    assert grew == {"onespec_prefix_cache_queries_total": 80,
                    "onespec_prefix_cache_hits_total": 32}
    assert 0.0 < after["onespec_prefix_cache_hit_rate"] < 1.0


# ---- in-process app: models without a chat template or a tokenizer ----------------------
def test_in_process_app_without_chat_template_or_tokenizer(tmp_path):
    from fastapi.testclient import TestClient

    from onespec.serve import create_app
    no_template, no_tok = tmp_path / "no-template", tmp_path / "no-tokenizer"
    make_hf_model(no_template, "llama", vocab_size=VOCAB_SIZE, num_layers=1)
    write_tokenizer(no_template, chat_template=None)
    make_hf_model(no_tok, "llama", vocab_size=VOCAB_SIZE, num_layers=1)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path in (no_template, no_tok):
        llm = LLM(str(path), device="cpu", dtype="float32")
        with TestClient(create_app(llm, "m")) as c:
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = c.post("/v1/completions", json={"model": "m", "prompt": [4, 5], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            r = c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == (200 if path == no_template else 400)
        assert_pool_full(llm)


# ---- incremental detokenization (worked examples; token id = one byte) ------------------
@pytest.mark.parametrize("steps,stop,deltas,text", [
    ([b"\xc3", b"\xa9!"], [], ["", "\u00e9!"], "\u00e9!"),           # é split over tokens
    ([b"xa", b"b", b"cd"], ["abc"], ["x", "", ""], "x"),            # hold "a", "ab"; cut
    ([b"xa", b"bz"], ["abc"], ["x", "abz"], "xabz"),                # false alarm released
    ([b"ab", b"c"], ["zz", "bc"], ["a", ""], "a"),                  # earliest stop wins
    ([b"x\xc3"], [], ["x\ufffd"], "x\ufffd"),                        # finished: flush all
])
def test_incremental_detokenizer(steps, stop, deltas, text):
    from onespec.serve.detokenize import IncrementalDetokenizer
    detok = IncrementalDetokenizer(lambda ids: bytes(ids).decode("utf-8", "replace"), stop)
    got = [detok.update(list(piece), finished=i == len(steps) - 1)
           for i, piece in enumerate(steps)]
    assert got == deltas and detok.text == text
    assert detok.stopped == (text != b"".join(steps).decode("utf-8", "replace"))
