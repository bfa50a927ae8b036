"""Prefix caching: block hashes chain their parents and never alias; lookups, reference
counts and LRU eviction in the block pool; exact cached-token counts; outputs with a cache
hit equal outputs without caching (greedy, seeded sampling, EAGLE-3 drafting, chunked
prefill, preemption, abort); drafts after a hit equal a from-scratch reference."""
from __future__ import annotations

import pytest
import torch

from conftest import (TEST_DEVICE, assert_drafts_match_reference, assert_pool_full,
                      make_eagle3_head, make_hf_model)
from onespec import LLM, Eagle3Config, SamplingParams
from onespec.engine.kv_cache import BlockPool
from onespec.engine.prefix_cache import PrefixCache, block_hash
from onespec.engine.request import Request

BS = 4                                   # block size of the engine tests
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def make_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


SHARED = make_tokens(26, 0)              # a shared prefix of 6.5 blocks
# the last but one leaves SHARED right after a block (whose draft KV depends on the next
# token); the last shares nothing
PROMPTS = [SHARED + make_tokens(n, 10 + n) for n in (3, 9, 1, 14)] + \
    [SHARED[:24] + make_tokens(7, 6), make_tokens(11, 5)]


# ---- hashes and the pool, without a model ----------------------------------------------
def request(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), GREEDY)


def computed(pool: BlockPool, tokens, rid="r") -> Request:
    """A request admitted to `pool` that has computed all of its tokens but the last
    (as after its prefill), blocks registered."""
    req = request(tokens, rid)
    hits = pool.match_prefix(req)
    pool.admit(req, hits, len(tokens))
    req.num_computed = len(tokens) - 1
    pool.cache_blocks(req)
    return req


def test_block_hash_chains_the_parent():
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    assert block_hash(None, a) == block_hash(None, a)
    assert len(block_hash(None, a)) == 32                        # SHA-256
    # equal tokens under different parents (and as a first block) hash differently
    hashes = {block_hash(None, b), block_hash(block_hash(None, a), b),
              block_hash(block_hash(None, (1, 2, 3, 5)), b)}
    assert len(hashes) == 3
    assert block_hash(None, (1, 2)) != block_hash(None, (2, 1))


def test_lookup_verifies_tokens_and_parent_even_when_hashes_collide():
    """Every block hashes to the same value: a lookup still takes only blocks whose tokens
    and parent record equal the request's."""
    pool = BlockPool(16, BS, PrefixCache(BS, hash_fn=lambda parent, key: b"same"))
    a = list(range(10, 22))                                       # 3 blocks
    computed(pool, a + [99])
    assert len(pool.match_prefix(request(a + [1]))) == 1           # the first record only
    assert pool.match_prefix(request([7] * 12 + [1])) == []        # other tokens: no hit
    # a colliding different block is not registered over the cached one
    other = computed(pool, [7] * 12 + [1], "o")
    assert [r.block_id for r in other.prefix_chain] == []
    assert len(pool.match_prefix(request(a + [1]))) == 1


def test_match_leaves_the_last_token_and_counts_lookahead():
    pool = BlockPool(16, BS, PrefixCache(BS))
    tokens = list(range(20, 32))                                  # exactly 3 blocks
    req = computed(pool, tokens + [5])                            # registers 3 blocks
    assert len(req.prefix_chain) == 3
    assert len(pool.match_prefix(request(tokens + [6]))) == 3
    # the whole prompt cached: its last block is computed again (logits need a row)
    assert len(pool.match_prefix(request(tokens))) == 2
    # with a lookahead token, a block matches only if the token after it matches too
    pool = BlockPool(16, BS, PrefixCache(BS, lookahead=1))
    computed(pool, tokens + [5])                                  # blocks 0..2 (3 has 1 token)
    assert len(pool.match_prefix(request(tokens + [5, 1]))) == 3
    assert len(pool.match_prefix(request(tokens + [6, 1]))) == 2  # block 2's lookahead differs
    assert len(pool.match_prefix(request(tokens[:8] + [0] * 5))) == 1


def test_reference_counts_and_lru_eviction_order():
    pool = BlockPool(7, BS, PrefixCache(BS))
    a = computed(pool, list(range(10, 18)) + [1], "a")            # blocks 0, 1 cached, 2
    b = computed(pool, list(range(30, 38)) + [1], "b")            # blocks 3, 4 cached, 5
    shared = request(list(range(10, 18)) + [2], "s")              # a's two blocks, then 6
    hits = pool.match_prefix(shared)
    assert [h.block_id for h in hits] == [0, 1]
    pool.admit(shared, hits, 9)
    assert shared.block_table == [0, 1, 6]
    assert [pool.ref_counts[i] for i in range(7)] == [2, 2, 1, 1, 1, 1, 1]
    assert pool.num_free_blocks == 0
    pool.free(a.block_table)                                      # 0, 1 still held
    assert pool.num_free_blocks == 1
    pool.free(b.block_table)                                      # b's blocks parked
    pool.free(shared.block_table)                                 # a's blocks parked later
    assert pool.num_free_blocks == pool.num_blocks                # cached blocks are free
    # never-cached blocks go first, most recently freed first (6, 5, 2: their pages are
    # resident), then parked ones, least recently released first and each request's tail
    # before its head: b's 4, 3, then a's 1, 0
    order = []
    for _ in range(pool.num_blocks):
        pool.allocate(table := [], 1)
        order += table
    assert order == [6, 5, 2, 4, 3, 1, 0]
    assert pool.match_prefix(request(list(range(10, 18)) + [2])) == []   # all evicted
    assert pool.cache.table == {} and pool.cache.records == {}


def test_eviction_takes_the_tail_of_a_prefix_first():
    """After one parked block is evicted the rest of its prefix still hits."""
    pool = BlockPool(4, BS, PrefixCache(BS))
    a = computed(pool, list(range(10, 22)) + [1], "a")            # 3 cached blocks + tail
    pool.free(a.block_table)
    pool.allocate(table := [], 2 * BS)                            # the tail, then block 2
    assert table == [3, 2]
    assert len(pool.match_prefix(request(list(range(10, 22)) + [1]))) == 2


def test_parked_hits_count_against_free_blocks():
    pool = BlockPool(4, BS, PrefixCache(BS))
    a = computed(pool, list(range(10, 22)) + [1], "a")            # 4 blocks, 3 cached
    pool.free(a.block_table)
    req = request(list(range(10, 22)) + [1, 2, 3, 4, 5], "b")
    hits = pool.match_prefix(req)
    assert len(hits) == 3
    assert pool.can_admit(hits, 16) and not pool.can_admit(hits, 17)
    pool.admit(req, hits, 16)
    assert pool.num_free_blocks == 0
    pool.free(req.block_table)
    assert pool.num_free_blocks == 4
# ---- the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama target and a random EAGLE-3 head for it."""
    target, head = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("head")
    hf = make_hf_model(target, "llama")
    make_eagle3_head(head, hf, draft_vocab_size=64, seed=3)
    return str(target), str(head), hf


def engine(models, cached: bool, k: int = 0, **kw) -> LLM:
    target, head, _ = models
    spec = Eagle3Config(head, max_draft_len=k) if k else None
    return LLM(target, speculative_config=spec, **{
        "dtype": "float32", "device": TEST_DEVICE, "block_size": BS,
        "enable_prefix_caching": cached, **kw})


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)


PARAMS = {"greedy": [GREEDY] * len(PROMPTS),
          "seeded": [sampled(40 + i) for i in range(len(PROMPTS))]}


def run_cached(llm: LLM, params) -> list:
    """PROMPTS[0] first (it fills the cache), then the rest at once."""
    return llm.generate(PROMPTS[:1], params[:1]) + llm.generate(PROMPTS[1:], params[1:])


def cached_counts(prompts, first_len: int, lookahead: int) -> list[int]:
    """The cached tokens each prompt must report after PROMPTS[0] (first_len tokens: the
    prompt and its outputs but the last) was computed: whole blocks of the common prefix
    whose lookahead tokens agree too, leaving one token to compute."""
    out = []
    for p in prompts:
        common = next((i for i, (x, y) in enumerate(zip(p, PROMPTS[0])) if x != y),
                      min(len(p), len(PROMPTS[0])))
        usable = min(common - lookahead, len(p) - 1, first_len - lookahead)
        out.append(max(usable, 0) // BS * BS)
    return out


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_tokens": 7},
                                       {"num_kv_blocks": 22, "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_outputs_equal_without_caching(models, k, kind, engine_kw):
    params = PARAMS[kind]
    want = token_ids(engine(models, False, k, **engine_kw).generate(PROMPTS, params))
    llm = engine(models, True, k, **engine_kw)
    outs = run_cached(llm, params)
    assert token_ids(outs) == want
    if "num_kv_blocks" in engine_kw:
        assert llm.stats()["num_preemptions"] > 0
    else:        # PROMPTS[0] and its outputs stayed cached: exact counts
        first_len = len(PROMPTS[0]) + 16 - 1
        assert [o.num_cached_tokens for o in outs] == \
            [0] + cached_counts(PROMPTS[1:], first_len, 1 if k else 0)
    assert outs[1].num_cached_tokens > 0
    stats = llm.stats()
    assert stats["num_cached_tokens"] == sum(o.num_cached_tokens for o in outs)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(
        stats["num_cached_tokens"] / sum(map(len, PROMPTS)))
    assert_pool_full(llm)


def test_outputs_continue_a_cached_conversation(models):
    """A prompt made of an earlier prompt and its output hits blocks computed while
    decoding (verify steps), and gives what an uncached engine gives."""
    llm, ref = engine(models, True, 3), engine(models, False, 3)
    first = llm.generate(PROMPTS[-1], GREEDY)[0]
    follow = PROMPTS[-1] + first.outputs[0].token_ids + [9, 10, 11]
    got = llm.generate(follow, GREEDY)[0]
    assert got.num_cached_tokens == (len(PROMPTS[-1]) + 16 - 1 - 1) // BS * BS
    assert got.outputs[0].token_ids == ref.generate(follow, GREEDY)[0].outputs[0].token_ids
    assert_pool_full(llm)


def test_abort_in_the_middle_of_a_cached_prefix(models):
    """A request aborted mid-prefill, its first chunk after a cache hit: its blocks return
    to the pool, the ones it completed stay cached, and later requests are exact."""
    llm = engine(models, True, 3, max_num_tokens=8)
    ref = engine(models, False, 3)
    eng = llm.engine
    llm.generate(PROMPTS[0], GREEDY)
    req = eng.add_request(PROMPTS[3], GREEDY)
    eng.step()
    assert req.metrics.num_cached_tokens == 24 and req.in_context
    assert 24 < req.num_computed < len(PROMPTS[3])
    eng.abort(req.request_id)
    assert not req.block_table
    assert_pool_full(llm)
    outs = llm.generate(PROMPTS[1:4], GREEDY)
    assert outs[2].num_cached_tokens == 32            # 24 found + 8 completed before abort
    assert token_ids(outs) == token_ids(ref.generate(PROMPTS[1:4], GREEDY))
    assert_pool_full(llm)


def test_drafts_after_a_cache_hit_match_the_reference(models):
    """The head's KV in cached blocks (written for other requests) is exactly what this
    request's own prefill would write: its drafts equal a cache-free reference."""
    from test_spec import reference_drafts
    _, _, hf = models
    llm = engine(models, True, 3, device="cpu")          # the reference runs on the CPU
    llm.generate(PROMPTS[0], GREEDY)
    drafter = llm.engine.drafter
    assert_drafts_match_reference(
        llm, PROMPTS[1:5], GREEDY,
        lambda ids: reference_drafts(hf, drafter.head, drafter.capture_layers, ids, 3), 3)
    assert llm.stats()["num_cached_tokens"] == 3 * 24 + 20


def kv_of(llm: LLM, req, num: int) -> list[torch.Tensor]:
    """Every layer's cached keys and values of req's first num positions (target, then
    draft layers)."""
    eng = llm.engine
    pos = torch.arange(num)
    slots = torch.tensor(req.block_table)[pos // BS] * BS + pos % BS
    layers = [layer.self_attn for layer in eng.model.model.layers]
    layers += eng.drafter.attention_layers if eng.drafter else []
    return [c[slots.to(c.device)].cpu() for a in layers for c in (a.k_cache, a.v_cache)]


def prefilled(llm: LLM, prompt):
    req = llm.engine.add_request(prompt, GREEDY)
    while req.in_context:
        llm.engine.step()
    return req


@pytest.mark.parametrize("k", [0, 3])
def test_cached_kv_equals_computed_kv(models, k):
    """After a hit, every layer's KV of the prompt, the head's included, equals what an
    uncached engine writes, also where the prompt leaves the cached prefix right after a
    block (the head's KV at a block's last position depends on the next token)."""
    llm, ref = engine(models, True, k), engine(models, False, k)
    llm.generate(PROMPTS[0], GREEDY)
    for prompt in PROMPTS[1], PROMPTS[4]:
        got, want = prefilled(llm, prompt), prefilled(ref, prompt)
        assert got.metrics.num_cached_tokens >= 20
        for a, b in zip(kv_of(llm, got, len(prompt)), kv_of(ref, want, len(prompt))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        llm.engine.abort(got.request_id)
        ref.engine.abort(want.request_id)
    assert_pool_full(llm)


def test_disabled_and_validated(models):
    llm = engine(models, False)
    assert llm.engine.pool.cache is None
    outs = run_cached(llm, PARAMS["greedy"])
    assert [o.num_cached_tokens for o in outs] == [0] * len(PROMPTS)
    assert llm.stats()["prefix_cache_hit_rate"] == 0.0
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine(models, "yes")


def test_forced_acceptance_caches_prompt_blocks_only(models):
    """Forced acceptance (by length or by per-position rates) emits tokens whose KV was
    computed for other tokens: only prompt blocks may be cached then."""
    target, head, _ = models
    for forced in (dict(force_acceptance_length=2.0),
                   dict(force_acceptance_rates=(0.5, 0.5, 0.5))):
        llm = LLM(target, speculative_config=Eagle3Config(head, max_draft_len=3, **forced),
                  dtype="float32", device=TEST_DEVICE, block_size=BS)
        assert llm.engine.pool.cache.prompt_only, forced
    assert not engine(models, True, k=3).engine.pool.cache.prompt_only


def test_cli_flag():
    from onespec.serve.cli import build_parser
    base = ["--model", "m"]
    assert build_parser().parse_args(base).enable_prefix_caching is True
    assert build_parser().parse_args(base + ["--no-enable-prefix-caching"]) \
        .enable_prefix_caching is False


def test_ttft_bench_tiny_cpu(capsys):
    import json

    from onespec.bench.prefix import main
    assert main(["--shape", "tiny", "--device", "cpu", "--prompt-len", "48",
                 "--cached-len", "32", "--trials", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [r.get("trial") for r in rows] == [0, None]
    last = rows[-1]
    assert last["bench"] == "prefix_ttft" and last["num_cached_tokens"] == 32
    assert last["ratio"] == pytest.approx(last["ttft_ms_cached"] / last["ttft_ms_uncached"],
                                          rel=1e-3)
