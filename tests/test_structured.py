"""Structured outputs on the bundled demo pair (a real byte-level tokenizer): JSON schemas,
regex, choice and EBNF constraints, greedy and sampled, plain and speculative; the
masks along the draft path and the matchers' rollback. Engines run on ONESPEC_TEST_DEVICE
like the other equivalence tests."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from conftest import TEST_DEVICE, assert_pool_full  # noqa: E402
from onespec import LLM, Eagle3Config, SamplingParams, StructuredOutputsParams  # noqa: E402
from onespec.demo import HEAD_DIR, TARGET_DIR  # noqa: E402

SCHEMAS = {
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["color", "size"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"type": "string", "maxLength": 4}}, "required": ["id", "tag"]}},
        "required": ["user"]},
    "array": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 2, "maxItems": 3}}, "required": ["xs"]},
    "nullable": {"type": "object", "properties": {
        "note": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        "ok": {"type": "boolean"}}, "required": ["note", "ok"]},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}}, "required": ["code"]},
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "let " name " = " num ";"\nname ::= [a-z] [a-z]? [a-z]?\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"let [a-z]{1,3} = [1-9][0-9]?;"
PROMPTS = ["def parse(line):\n", "config = ", "import json\n\n", "    return "]
MAX_TOKENS = 48


# Engines here take max_batch_size=16: the KV pool holds max_batch_size requests of the
# model's full length, which for the 24-layer demo target at the default 64 is 3.4 GB each.
@pytest.fixture(scope="module")
def plain():
    return LLM(TARGET_DIR, device=TEST_DEVICE, dtype="float32", max_batch_size=16)


@pytest.fixture(scope="module")
def spec():
    return LLM(TARGET_DIR, device=TEST_DEVICE, dtype="float32", max_batch_size=16,
               speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=3))


@pytest.fixture(scope="module")
def spec_rs():
    return LLM(TARGET_DIR, device=TEST_DEVICE, dtype="float32", max_batch_size=16,
               speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=3,
                                               use_rejection_sampling=True))


def constrained(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=so, **kw)


def check(kind: str, spec_value, text: str):
    if kind == "json":
        jsonschema.validate(json.loads(text), spec_value)
        assert text == json.dumps(json.loads(text), separators=(",", ":"),
                                  ensure_ascii=False), text     # compact
    elif kind == "regex":
        assert re.fullmatch(spec_value, text), text
    elif kind == "choice":
        assert text in spec_value
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


def assert_constrained_spec_equals_plain(path: str, cases, prompts, speculative_config):
    """Each case's constrained greedy output of a speculative engine on the checkpoint at
    `path` equals the plain engine's, which stops at the end of the grammar and is valid;
    drafts were accepted; the pool is full again."""
    params = [constrained(so) for _, _, so in cases]
    ref = LLM(path, device=TEST_DEVICE, dtype="float32").generate(prompts, params)
    llm = LLM(path, device=TEST_DEVICE, dtype="float32", speculative_config=speculative_config)
    out = llm.generate(prompts, params)
    for (kind, value, _), r, o in zip(cases, ref, out):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, kind
        assert r.outputs[0].finish_reason == "stop", (kind, r.outputs[0].text)
        check(kind, value, r.outputs[0].text)
    assert llm.stats()["num_accepted_draft_tokens"] > 0
    assert_pool_full(llm)


CASES = [("json", s, StructuredOutputsParams(json=s)) for s in SCHEMAS.values()] + [
    ("regex", REGEX, StructuredOutputsParams(regex=REGEX)),
    ("choice", CHOICES, StructuredOutputsParams(choice=CHOICES)),
    ("grammar", GRAMMAR, StructuredOutputsParams(grammar=GRAMMAR)),
]


def test_greedy_valid_and_speculative_equals_plain(plain, spec):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]
    params = [constrained(so) for _, _, so in CASES]
    ref = plain.generate(prompts, params)
    out = spec.generate(prompts, params)
    for (kind, value, _), r, o in zip(CASES, ref, out):
        assert r.outputs[0].finish_reason == "stop", (kind, r.outputs[0].text)
        check(kind, value, r.outputs[0].text)
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, kind
    assert spec.stats()["num_accepted_draft_tokens"] > 0
    assert_pool_full(plain)
    assert_pool_full(spec)


@pytest.mark.parametrize("which", ["plain", "spec_rs"])
def test_sampled_outputs_are_valid(request, which):
    llm = request.getfixturevalue(which)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]
    params = [constrained(so, temperature=1.0, seed=i) for i, (_, _, so) in enumerate(CASES)]
    for (kind, value, _), o in zip(CASES, llm.generate(prompts, params)):
        assert o.outputs[0].finish_reason == "stop", (kind, o.outputs[0].text)
        check(kind, value, o.outputs[0].text)
    assert_pool_full(llm)


def test_json_object_and_mixed_batch(plain, spec):
    """Free requests in a batch with constrained ones give what they give alone."""
    free = SamplingParams(max_tokens=12)
    alone = plain.generate(PROMPTS, free)
    so = StructuredOutputsParams(json_object=True)
    params = [free, constrained(so), free, constrained(StructuredOutputsParams(regex=REGEX))]
    for llm in (plain, spec):
        out = llm.generate(PROMPTS, params)
        for i in (0, 2):
            assert out[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
        obj = out[1].outputs[0]
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict)
        else:      # an open-ended object may run out of tokens, but stays a JSON prefix
            assert obj.text.startswith("{") and obj.finish_reason == "length"
        assert re.fullmatch(REGEX, out[3].outputs[0].text)
        assert_pool_full(llm)


def grammar_accepts(llm, so, tokens: list[int]) -> bool:
    """Whether a fresh matcher of `so` accepts `tokens` one by one (until it terminates)."""
    m = llm.engine.grammars.matcher(so)
    for t in tokens:
        if m.is_terminated():
            return True
        if not m.accept_token(t):
            return False
    return True


def test_drafts_follow_the_grammar_and_invalid_drafts_are_rejected(plain, spec):
    """Every draft the masked draft loop proposes continues the output validly; drafts
    that break the grammar (planted before a step) are never accepted, and the output is
    the same as plain decoding's."""
    so = StructuredOutputsParams(regex=r"[0-9]{6}-[0-9]{6}")
    tok = spec.tokenizer
    bad = tok.encode("abc")[:3]
    ref = plain.generate(PROMPTS[0], constrained(so))[0].outputs[0]
    engine = spec.engine
    req = engine.add_request(PROMPTS[0], constrained(so))
    steps = 0
    while not req.is_finished:
        if req.draft_tokens and steps % 2:
            req.draft_tokens = (bad * 3)[:len(req.draft_tokens)]      # grammar-breaking
            before = req.metrics.num_accepted_draft_tokens
            engine.step()
            assert req.metrics.num_accepted_draft_tokens == before
        else:
            engine.step()
            if not req.is_finished and req.draft_tokens:
                assert grammar_accepts(spec, so, req.output_token_ids + req.draft_tokens)
        steps += 1
    assert req.output_token_ids == ref.token_ids
    assert re.fullmatch(r"[0-9]{6}-[0-9]{6}", spec.decode(req.output_token_ids))
    assert_pool_full(spec)


def test_chunked_prefill_and_preemption_keep_the_matchers_in_step(plain):
    """Recomputed requests resume their grammar where their output left it."""
    cases = CASES[:4] + CASES[5:]
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(len(cases))]
    params = [constrained(so) for _, _, so in cases]
    ref = plain.generate(prompts, params)
    tight = LLM(TARGET_DIR, device=TEST_DEVICE, dtype="float32", block_size=4,
                max_model_len=64, num_kv_blocks=24, max_num_tokens=16,
                speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=3))
    out = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
    assert_pool_full(tight)


def test_forced_acceptance_emits_valid_runs():
    """Benchmark mode (forced acceptance counts) under a constraint: the emitted runs are the
    masked drafts and the target's token after them, so the output stays valid."""
    llm = LLM(TARGET_DIR, device=TEST_DEVICE, dtype="float32", max_batch_size=16,
              speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=3,
                                              force_acceptance_length=3.5))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]
    out = llm.generate(prompts, [constrained(so) for _, _, so in CASES])
    for (kind, value, _), o in zip(CASES, out):
        assert o.outputs[0].finish_reason == "stop", (kind, o.outputs[0].text)
        check(kind, value, o.outputs[0].text)
    assert llm.stats()["acceptance_length"] > 2
    assert_pool_full(llm)


def test_forced_acceptance_stops_at_drafts_the_grammar_rejects(tmp_path):
    """A draft vocabulary that lacks the tokens a grammar needs gives drafts the grammar
    rejects; benchmark mode's forced counts must end the emitted run before them."""
    target, head = tmp_path / "target", tmp_path / "head"
    target.mkdir(), head.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TARGET_DIR, name), target)
    with open(os.path.join(HEAD_DIR, "config.json")) as f:
        head_cfg = json.load(f)
    (head / "config.json").write_text(json.dumps({**head_cfg, "draft_vocab_size": 32}))
    llm = LLM(str(target), device=TEST_DEVICE, dtype="float32", load_format="dummy",
              max_batch_size=16, speculative_config=Eagle3Config(
                  str(head), max_draft_len=3, force_acceptance_length=4.0))
    cases = [("choice", CHOICES, StructuredOutputsParams(choice=CHOICES)),
             ("grammar", GRAMMAR_RE, StructuredOutputsParams(grammar=GRAMMAR))]
    out = llm.generate([PROMPTS[0]] * 2, [constrained(so) for _, _, so in cases])
    for (kind, value, _), o in zip(cases, out):
        assert o.outputs[0].finish_reason == "stop", (kind, o.outputs[0].text)
        check(kind, value, o.outputs[0].text)
    assert_pool_full(llm)


def test_grammar_end_stops_even_with_ignore_eos(plain):
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = plain.generate(PROMPTS[1], constrained(so, ignore_eos=True))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("kwargs,message", [
    (dict(json={"type": "bogus"}), "structured_outputs.json is invalid: Unsupported type"),
    (dict(regex="(ab"), "structured_outputs.regex is invalid: Regex parsing error"),
    (dict(grammar="root ::= missing"), "structured_outputs.grammar is invalid: EBNF parser"),
])
def test_bad_spec_is_a_value_error_and_the_next_request_runs(spec, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.generate(PROMPTS[0], constrained(StructuredOutputsParams(**kwargs)))
    assert_pool_full(spec)
    out = spec.generate(PROMPTS[0], constrained(StructuredOutputsParams(choice=CHOICES)))
    assert out[0].outputs[0].text in CHOICES


@pytest.mark.parametrize("kwargs,message", [
    (dict(), "exactly one of json, regex, choice, grammar or json_object, got none"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{oops"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON schema object"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar=5), "structured_outputs.grammar must be a non-empty string"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", ""]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice="ab"), "structured_outputs.choice must be a non-empty list"),
    (dict(json_object="yes"), "structured_outputs.json_object must be True or False"),
])
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs must be None or a "
                                         "StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    so = StructuredOutputsParams(json='{"type": "object"}')
    assert so.json == {"type": "object"} and so.kind == "json"


@pytest.mark.parametrize("vanilla,k", [(False, 3), (True, 2)])
def test_mtp_greedy_equals_plain_under_constraints(tmp_path, vanilla, k):
    """MTP drafting (a tiny DeepSeek-V3 target with a byte-level tokenizer of its vocab)."""
    from moe_utils import add_mtp_layers, make_deepseek_model
    from onespec import MTPConfig
    from test_serve import write_tokenizer
    hf = make_deepseek_model(tmp_path, mtp_layers=2, vocab_size=300)
    add_mtp_layers(tmp_path, hf, 2)
    write_tokenizer(tmp_path, 300, chat_template=None)
    cases = [CASES[0], CASES[2], CASES[5], CASES[6], CASES[7]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    assert_constrained_spec_equals_plain(str(tmp_path), cases, prompts, MTPConfig(
        num_nextn_predict_layers=k, use_mtp_vanilla=vanilla))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,forced", [(0, None), (3, None), (3, 4.0)])
def test_constrained_steps_from_cuda_graphs_equal_eager_steps(k, forced):
    """Generation batches with constrained requests run from CUDA graphs (the host fills the
    masks between the verify graph and each draft step's graph): the same tokens as eager
    steps, for a batch mixing schemas, a regex, a choice and a free request, padded to a
    bucket, with and without forced acceptance."""
    cases = [CASES[0], CASES[1], CASES[5], CASES[6]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases) + 1)]
    params = [constrained(so) for _, _, so in cases] + [SamplingParams(max_tokens=MAX_TOKENS)]
    spec = Eagle3Config(HEAD_DIR, max_draft_len=k, force_acceptance_length=forced) \
        if k else None
    runs = []
    for graphs in (False, True):
        llm = LLM(TARGET_DIR, device="cuda", dtype="float32", cuda_graphs=graphs,
                  max_batch_size=8, speculative_config=spec)
        out = llm.generate(prompts, params)
        runs.append([o.outputs[0].token_ids for o in out])
        for (kind, value, _), o in zip(cases, out):
            assert o.outputs[0].finish_reason == "stop", (kind, o.outputs[0].text)
            check(kind, value, o.outputs[0].text)
        assert_pool_full(llm)
        if graphs:
            assert llm.engine.runner.graphs.num_constrained > 0
            # verify rows 0..K-1 take the masks the draft loop filled for the same states
            assert (llm.engine.runner.graphs.num_reused_masks > 0) == bool(k)
    assert runs[0] == runs[1]


def first_allowed(row: torch.Tensor) -> int:
    """The lowest token id a bitmask row [W] (int32, xgrammar's layout) allows."""
    bits = (row[:, None].to(torch.int64) >> torch.arange(32)) & 1
    return int(bits.reshape(-1).nonzero()[0])


def test_verify_rows_reuse_the_draft_loops_masks(spec, monkeypatch):
    """A graphed step keeps the masks its draft loop filled (DraftMasks); the next step's
    verify rows 0..K-1 are the same matcher states, so they take those masks and only row K
    is filled. Reused and freshly filled verify masks are identical, for a constrained and
    a free request; a changed draft or a request that emitted other tokens fills afresh."""
    from onespec.engine.request import Request
    from onespec.engine.scheduler import ScheduledBatch
    from onespec.structured.state import GrammarState
    from onespec.structured.step import StepGrammar
    backend, k = spec.engine.grammars, 3
    so = CASES[0][2]
    reqs = [Request("c", [1, 2], constrained(so)), Request("f", [1, 2], SamplingParams())]
    reqs[0].features.grammar = GrammarState(backend.matcher(so))
    batch = ScheduledBatch([], reqs, k)
    # a step that verifies nothing the grammar allows past row 0, then drafts under masks
    step = StepGrammar(backend, batch, [[0] * k, [0] * k], [0, 1], "cpu", host_only=True)
    first = first_allowed(step.verify.host[0])
    masks, drafts = [step.start([], [[first] + [0] * k, [5] * (k + 1)], [1, 1])], []
    for j in range(k):
        drafts.append([first_allowed(masks[-1].host[0]), 7])
        if j < k - 1:
            masks.append(step.advance(drafts[-1]))
    drafts = [list(d) for d in zip(*drafts)]           # [Bg][K]
    step.keep_draft_masks(reqs, masks, drafts, [1, 1])
    step.rollback()
    for req, token in zip(reqs, (first, 5)):           # what postprocess does
        req.output_token_ids.append(token)
        if req.features.grammar is not None:
            assert req.features.grammar.accept(token, 0) is None
    fills = []
    monkeypatch.setattr(backend, "fill", lambda m, b, indices: (
        fills.append(len(indices)), type(backend).fill(backend, m, b, indices))[1])

    def verify_masks(reuse: bool, verified=drafts) -> tuple[torch.Tensor, int]:
        kept = reqs[0].features.grammar.draft_masks
        if not reuse:
            reqs[0].features.grammar.draft_masks = None
        fills.clear()
        g = StepGrammar(backend, batch, verified, [0, 1], "cpu", host_only=True)
        g.rollback()
        reqs[0].features.grammar.draft_masks = kept
        return g.verify.host, g.reused

    fresh, none = verify_masks(False)
    assert none == 0 and len(fills) == k + 1
    reused, n = verify_masks(True)
    assert n == k and len(fills) == 1                  # row K only
    assert torch.equal(reused, fresh)
    assert (fresh[:k + 1] != -1).any() and (fresh[k + 1:] == -1).all()   # c masked, f free
    other = [drafts[0][:-1] + [drafts[0][-1] + 1], drafts[1]]
    assert verify_masks(True, other)[1] == 0           # another draft: filled afresh
    reqs[0].output_token_ids.append(first)
    assert verify_masks(True)[1] == 0                  # other emitted tokens: afresh
