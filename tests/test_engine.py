"""Engine behaviour without drafting: sampling, stop conditions, length limits, continuous
batching, metrics, abort, and a KV pool that is always full again afterwards."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_pool_full, hf_greedy
from onespec import LLM, SamplingParams

ARCH = "llama"
MAX_NEW = 24


def make_prompts(lens, vocab: int = 128, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


PROMPTS = make_prompts((5, 12, 1, 30, 9, 17, 3, 22))


_REFS: dict[int, list[int]] = {}


@pytest.fixture(scope="module")
def hf(tiny_models):
    return tiny_models[ARCH][1]


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models[ARCH][0]


def ref(hf, i: int) -> list[int]:
    """transformers' greedy continuation (MAX_NEW tokens) of PROMPTS[i], computed once."""
    if i not in _REFS:
        _REFS[i] = hf_greedy(hf, PROMPTS[i], MAX_NEW)
    return _REFS[i]


@pytest.fixture(scope="module")
def shared_llm(path):
    return LLM(path, dtype="float32", device="cpu")


@pytest.fixture
def llm(shared_llm):
    """The module's engine; after each test its KV pool must be whole again."""
    yield shared_llm
    assert_pool_full(shared_llm)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def sampled(temperature=1.0, seed=None, max_tokens=MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          ignore_eos=True, **kw)


# ---- sampling ------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent(llm, hf):
    p = PROMPTS[0]
    alone = tokens(llm.generate([p], sampled(seed=7)))[0]
    assert tokens(llm.generate([p], sampled(seed=7)))[0] == alone
    # the same request among others (unseeded, other seeds, greedy), in another batch slot
    mixed = llm.generate([PROMPTS[3], PROMPTS[1], p, PROMPTS[2]],
                         [sampled(), sampled(seed=8), sampled(seed=7), sampled(0.0)])
    got = tokens(mixed)
    assert got[2] == alone
    assert got[3] == ref(hf, 2)           # a greedy row in a sampling batch stays greedy
    others = {tuple(tokens(llm.generate([p], sampled(seed=s)))[0]) for s in (8, 9, 10)}
    assert tuple(alone) not in others and len(others) == 3
    assert alone != ref(hf, 0)            # it really sampled


def test_seeded_sampling_is_independent_of_chunking_and_preemption(llm, path):
    """Prefill chunks that give no token, and recomputation after preemption, must not
    advance a request's generator."""
    sp = sampled(seed=11)
    alone = tokens(llm.generate([PROMPTS[3]], sp))[0]           # 30-token prompt, one chunk
    chunked = LLM(path, dtype="float32", device="cpu", max_num_tokens=8)
    assert tokens(chunked.generate([PROMPTS[3]], sp))[0] == alone
    assert_pool_full(chunked)
    tight = LLM(path, dtype="float32", device="cpu", block_size=4, max_model_len=64,
                num_kv_blocks=17, max_num_tokens=16)
    outs = tokens(tight.generate(PROMPTS[:4], [sampled(seed=20), sampled(seed=21),
                                               sampled(seed=22), sp]))
    assert tight.stats()["num_preemptions"] > 0
    assert outs[3] == alone
    assert outs[0] == tokens(llm.generate([PROMPTS[0]], sampled(seed=20)))[0]
    assert_pool_full(tight)


def test_unseeded_sampling_runs(llm):
    outs = llm.generate(PROMPTS[:3], sampled(temperature=0.8))
    for o in outs:
        assert len(o.outputs[0].token_ids) == MAX_NEW
        assert all(0 <= t < 128 for t in o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length"


def test_top_k_1_is_greedy(llm, hf):
    outs = llm.generate(PROMPTS[:4], sampled(temperature=1.5, seed=3, top_k=1))
    assert tokens(outs) == [ref(hf, i) for i in range(4)]


@torch.no_grad()
def allowed_sets(hf, prompt, output, temperature, top_k, top_p, slack=1e-4):
    """For each output position, the tokens that top-k / top-p (with a small slack for
    float differences) allow, from transformers' logits of the prefix; and the argmaxes."""
    seq = torch.tensor([prompt + output])
    logits = hf(seq).logits[0, len(prompt) - 1:-1].float() / temperature     # [n, V]
    probs = logits.softmax(-1)
    sets = []
    for row_logits, row_probs in zip(logits, probs):
        ok = torch.ones_like(row_probs, dtype=torch.bool)
        if top_k:
            kth = row_logits.topk(top_k).values[-1]
            ok &= row_logits >= kth - slack
            row_probs = torch.where(ok, row_probs, 0.0)
            row_probs = row_probs / row_probs.sum()
        if top_p < 1.0:
            # kept iff the mass of strictly more probable tokens is < top_p
            mass_above = (row_probs[None, :] * (row_probs[None, :] > row_probs[:, None])).sum(-1)
            ok &= mass_above < top_p + slack
        sets.append(set(torch.nonzero(ok).flatten().tolist()))
    return sets, logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.5), (6, 0.7)])
def test_top_k_top_p_never_emit_filtered_tokens(llm, hf, top_k, top_p):
    temperature = 2.0          # flat enough that unfiltered sampling leaves the allowed set
    prompts = PROMPTS[:4]
    params = [sampled(temperature, seed=100 + i, top_k=top_k, top_p=top_p)
              for i in range(len(prompts))]
    num_checked = num_not_argmax = num_filtering = 0
    for prompt, out in zip(prompts, tokens(llm.generate(prompts, params))):
        allowed, argmax = allowed_sets(hf, prompt, out, temperature, top_k, top_p)
        for j, (t, ok) in enumerate(zip(out, allowed)):
            assert t in ok, f"token {t} at step {j} is filtered out (allowed {sorted(ok)})"
            num_checked += 1
            num_not_argmax += t != argmax[j]
            num_filtering += len(ok) < 128
    assert num_checked == len(prompts) * MAX_NEW
    assert num_not_argmax > 0                       # it sampled, it did not decode greedily
    assert num_filtering == num_checked             # every step had something filtered out
    # without the filters the same seeds leave the allowed sets: the check has teeth
    free = tokens(llm.generate(prompts, [sampled(temperature, seed=100 + i)
                                         for i in range(len(prompts))]))
    escaped = sum(t not in ok for prompt, out in zip(prompts, free)
                  for t, ok in zip(out, allowed_sets(hf, prompt, out, temperature, top_k,
                                                     top_p)[0]))
    assert escaped > 0


# ---- stop conditions and lengths -----------------------------------------------------------
def test_stop_token_ids_stop(llm, hf):
    full = ref(hf, 1)
    stop = full[5]
    first = full.index(stop)
    out, = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop]))
    assert out.outputs[0].token_ids == full[:first + 1]
    assert out.outputs[0].finish_reason == "stop"


@pytest.fixture
def eos_model(path, hf, tmp_path):
    """The same weights, with an EOS id (a list, as some configs have) that greedy decoding
    of PROMPTS[1] emits at step 4 or before."""
    full = ref(hf, 1)
    eos = full[4]
    unused = next(t for t in range(3, 128) if t not in full)
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eos_token_id"] = [unused, eos]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path), full, full.index(eos)


def test_eos_stops_unless_ignore_eos(eos_model):
    path, full, first = eos_model
    llm = LLM(path, dtype="float32", device="cpu")
    out, = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_NEW))
    assert out.outputs[0].token_ids == full[:first + 1]
    assert out.outputs[0].finish_reason == "stop"
    out, = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert out.outputs[0].token_ids == full
    assert out.outputs[0].finish_reason == "length"
    assert_pool_full(llm)


def test_max_tokens_finishes_with_length(llm, hf):
    outs = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=n, ignore_eos=True)
                                      for n in (1, 5, 11)])
    for i, (o, n) in enumerate(zip(outs, (1, 5, 11))):
        assert o.outputs[0].token_ids == ref(hf, i)[:n]
        assert o.outputs[0].finish_reason == "length"
        assert o.finished


def test_max_model_len_caps_the_output(path, hf):
    max_len = 20
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=max_len)
    assert llm.engine.max_model_len == max_len
    which = (1, 2, 5)                                     # 12, 1 and 17 prompt tokens
    outs = llm.generate([PROMPTS[i] for i in which],
                        SamplingParams(max_tokens=100, ignore_eos=True))
    for i, o in zip(which, outs):
        n = max_len - len(PROMPTS[i])
        assert o.outputs[0].token_ids == ref(hf, i)[:n]
        assert o.outputs[0].finish_reason == "length"
    assert_pool_full(llm)


def test_continuous_batching_matches_transformers(path, hf):
    llm = LLM(path, dtype="float32", device="cpu", max_batch_size=2, max_num_tokens=16)
    lengths = [MAX_NEW - 3 * (i % 4) for i in range(len(PROMPTS))]
    seen_batch_sizes = []
    step = llm.engine.step
    llm.engine.step = lambda: seen_batch_sizes.append(llm.engine.num_running()) or step()
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True)
                                  for n in lengths])
    for i, (o, n) in enumerate(zip(outs, lengths)):
        assert o.outputs[0].token_ids == ref(hf, i)[:n], f"request {i}"
    assert max(seen_batch_sizes) == 2
    assert_pool_full(llm)


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_without_drafting(path):
    llm = LLM(path, dtype="float32", device="cpu", max_num_tokens=8)   # chunked prefill too
    lengths = (3, 9, 1, 14)
    outs = llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=n, ignore_eos=True)
                                      for n in lengths])
    for o, n in zip(outs, lengths):
        m = o.metrics
        assert len(o.outputs[0].token_ids) == n
        assert m.target_steps == n
        assert m.num_generated_tokens == n
        assert m.num_draft_tokens == 0 and m.num_accepted_draft_tokens == 0
        assert m.acceptance_length == 1.0
    s = llm.stats()
    assert s["num_requests"] == len(lengths)
    assert s["target_steps"] == s["num_generated_tokens"] == sum(lengths)
    assert s["num_draft_tokens"] == 0 and s["num_accepted_draft_tokens"] == 0
    assert s["acceptance_length"] == 1.0
    assert s["acceptance_rate"] == 0.0
    assert s["acceptance_rate_per_position"] == []
    llm.generate(PROMPTS[4], SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.stats()["num_requests"] == len(lengths) + 1
    assert llm.stats()["target_steps"] == sum(lengths) + 2
    assert_pool_full(llm)


# ---- failures and aborts -------------------------------------------------------------------
@pytest.mark.parametrize("where", ["engine.step", "runner.run"])
def test_exception_inside_generate_frees_everything(llm, hf, monkeypatch, where):
    owner = llm.engine if where == "engine.step" else llm.engine.runner
    name = where.split(".")[1]
    original = getattr(owner, name)
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:4], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert len(calls) == 4
    assert_pool_full(llm)
    assert not llm.engine.requests
    monkeypatch.undo()
    # the engine is still usable and still exact
    assert tokens(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))) \
        == [ref(hf, 0), ref(hf, 1)]


def test_abort_decoding_prefilling_and_waiting_requests(path, hf):
    llm = LLM(path, dtype="float32", device="cpu", max_batch_size=2, max_num_tokens=8)
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    order = (0, 3, 1, 2)                                  # 5, 30, 12 and 1 prompt tokens
    reqs = [eng.add_request(PROMPTS[i], sp) for i in order]
    for _ in range(2):
        eng.step()
    decoding, prefilling, waiting = reqs[0], reqs[1], reqs[3]
    assert 0 < len(decoding.output_token_ids) < MAX_NEW and decoding.block_table
    assert prefilling.in_context and 0 < prefilling.num_computed < len(PROMPTS[3])
    assert prefilling.block_table
    assert not waiting.output_token_ids and not waiting.block_table
    for req in (decoding, prefilling, waiting):
        eng.abort(req.request_id)
        assert req.finish_reason == "abort" and not req.block_table
    eng.abort("no-such-request")                                   # ignored
    while eng.has_unfinished():
        eng.step()
    assert decoding.output_token_ids == ref(hf, 0)[:len(decoding.output_token_ids)]
    assert not prefilling.output_token_ids and not waiting.output_token_ids
    assert reqs[2].output_token_ids == ref(hf, 1)
    assert reqs[2].finish_reason == "length"
    assert_pool_full(llm)


def _running_request(sched, prompt_len: int, max_tokens: int, k: int):
    """A request taken through its prefill by the real scheduler, then into generation."""
    from onespec.engine.request import Request
    from onespec.engine.scheduler import StepOutput
    req = Request("r", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    sched.add(req)
    batch = sched.schedule(k)
    sched.postprocess(batch, StepOutput([7], [], [], [[8] * k]))
    assert not req.in_context and req.num_computed == prompt_len
    return req


def test_reserve_ahead_reserves_one_more_step_or_nothing():
    """The overlap scheduler's reservation (Scheduler.reserve_ahead): room for a step of k
    drafts after the in-flight one accepts up to k + 1 tokens; refused, with nothing
    allocated or preempted, when the pool is short or the in-flight step could end the
    request by length."""
    from onespec.engine.kv_cache import BlockPool
    from onespec.engine.scheduler import Scheduler
    k, bs = 3, 4
    sched = Scheduler(BlockPool(8, bs), 64, 4, 64, True, (2,))
    req = _running_request(sched, 10, 40, k)
    assert sched.reserve_ahead(req, k)
    # positions up to num_computed + (k + 1) + max(k + 1, 2k) - 1 have slots
    assert len(req.block_table) * bs >= req.num_computed + (k + 1) + 2 * k
    free = sched.pool.num_free_blocks
    # too few output tokens left: the step in flight may finish the request
    req.sampling_params = SamplingParams(max_tokens=len(req.output_token_ids) + k + 1)
    assert not sched.reserve_ahead(req, k)
    req.sampling_params = SamplingParams(max_tokens=40)
    sched.max_model_len = req.num_tokens + k + 1
    assert not sched.reserve_ahead(req, k)
    sched.max_model_len = 64
    # a pool too small for the next step refuses instead of preempting
    req.num_computed += 4 * bs * free
    assert not sched.reserve_ahead(req, k)
    assert sched.pool.num_free_blocks == free and sched.running == [req]


def test_postprocess_drops_rows_of_finished_requests():
    """A step's row for a request that finished (or was aborted) while the step was in
    flight changes nothing."""
    from onespec.engine.kv_cache import BlockPool
    from onespec.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
    sched = Scheduler(BlockPool(8, 4), 64, 4, 64, True, (2,))
    req = _running_request(sched, 5, 40, 2)
    batch = ScheduledBatch([], [req], 2)
    sched.abort(req)
    before = (list(req.output_token_ids), req.num_computed, vars(req.metrics).copy())
    assert sched.postprocess(batch, StepOutput([], [[9, 10, 11]], [3], [[4, 5]])) == []
    assert (req.output_token_ids, req.num_computed, vars(req.metrics)) == before
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_kernel_settings_fixed_at_construction(llm):
    """The engine builds its kernel settings once (frozen) and every layer of the model
    computes with the one backend made from them: on the CPU, the PyTorch operations."""
    import dataclasses

    from onespec.kernels.settings import KernelSettings
    from onespec.layers.ops import TorchOps
    eng = llm.engine
    assert eng.kernel_settings == KernelSettings(triton=False, pdl=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        eng.kernel_settings.triton = True
    assert type(eng.ops) is TorchOps
    holders = [m for m in eng.model.modules() if hasattr(m, "ops")]
    assert len(holders) == 1 + 3 * eng.model.config.num_hidden_layers   # model, layer parts
    assert all(m.ops is eng.ops for m in holders)
