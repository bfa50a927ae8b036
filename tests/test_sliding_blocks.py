"""A target whose every attention layer slides (Mistral's `sliding_window`): the blocks
behind a running request's window go back to the pool while it runs. Output equals
transformers token for token (plain, chunked, prefix-cached, preempted, with n-gram and
EAGLE-3 drafts), a request many windows long holds a bounded number of blocks at every
step, a second request runs in the blocks the first gave back, and the pool is full
again after every run."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, hf_greedy, make_eagle3_head, make_hf_model
from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
from onespec.engine.kv_cache import slots_per_step

WINDOW, BLOCK = 8, 4
NEW_TOKENS = 72                                   # with the prompts: 10+ windows a request


def make_prompts(lens, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


PROMPTS = make_prompts((6, 30))                   # shorter and longer than the window


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """(target dir, head dir, transformers' greedy continuations of PROMPTS)."""
    path = tmp_path_factory.mktemp("mistral")
    hf = make_hf_model(path, "mistral", num_layers=2, hidden_size=32, sliding_window=WINDOW)
    head = tmp_path_factory.mktemp("head")
    make_eagle3_head(head, hf, seed=3)
    return str(path), str(head), [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def held_bound(k: int, drafting: bool, chunk: int = 1) -> int:
    """Blocks a request may hold after a step: the one holding its window's first key to
    the one holding the last slot the next step may write (or its next prefill chunk;
    on CUDA the overlap scheduler reserves k + 1 slots more, before num_computed moves)."""
    span = WINDOW + max(slots_per_step(k, drafting) + 2 * (k + 1), chunk)
    return span // BLOCK + 2


def run_stepping(llm, prompts, bound: int):
    """Steps the engine to the end; after every step each running request holds at most
    `bound` blocks and the pool's free count is the pool less what the requests hold.
    Returns (token ids, the most blocks any request held, whether requests ran at once
    with more positions between them than the pool has slots, every step's drafts)."""
    eng = llm.engine
    pool = eng.pool
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    most, overlapped, drafts = 0, False, []
    while eng.has_unfinished():
        drafts.append([(r.request_id, list(r.draft_tokens)) for r in eng.step()])
        running = eng.scheduler.running
        held = [pool.num_held(r.block_table) for r in running]
        assert all(h <= bound for h in held), (held, bound)
        if pool.cache is None:
            assert pool.num_free_blocks == pool.num_blocks - sum(held)
        most = max([most, *held])
        overlapped |= len(running) > 1 and \
            sum(r.num_computed for r in running) > pool.num_blocks * pool.block_size
    assert all(r.is_finished for r in reqs)
    assert_pool_full(llm)
    return [r.output_token_ids for r in reqs], most, overlapped, drafts


@pytest.mark.parametrize("mode", ["plain", "chunked", "no-prefix-cache"])
def test_long_requests_hold_a_window_of_blocks(sliding, mode):
    """Requests 10+ windows long equal transformers token for token, while each holds at
    most window / block_size + 2 (+ a step's slots) blocks after every step; without the
    release a request's blocks would grow to 20+."""
    path, _, refs = sliding
    kw = {"chunked": dict(max_num_tokens=5),
          "no-prefix-cache": dict(enable_prefix_caching=False)}.get(mode, {})
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=BLOCK, max_model_len=128,
              **kw)
    chunk = kw.get("max_num_tokens", max(map(len, PROMPTS)))
    outs, most, _, _ = run_stepping(llm, PROMPTS, held_bound(0, False, chunk))
    assert outs == refs
    assert most < (len(PROMPTS[1]) + NEW_TOKENS) // BLOCK // 2
    llm.close()


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculation_is_lossless_with_released_blocks(sliding, method):
    """n-gram and EAGLE-3 drafts (K=3: the draft steps write up to 2K slots ahead) leave
    greedy output equal to transformers', with the same bound on the blocks held. The
    head's layers keep the target's window in every draft step, so its drafts equal those
    of an engine that keeps every block (a draft reading a released block would differ);
    n-gram drafts are accepted on these looping outputs."""
    path, head, refs = sliding
    sc = NGramConfig(max_draft_len=3) if method == "ngram" else \
        Eagle3Config(draft_model=head, max_draft_len=3, layers_to_capture=(0, 1, 1))
    runs = []
    for release in (True, False):
        llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=BLOCK,
                  max_model_len=128, speculative_config=sc)
        if not release:
            llm.engine.scheduler.sliding_window = None        # keeps every block
        bound = held_bound(3, method == "eagle3", max(map(len, PROMPTS))) if release else 99
        outs, most, _, drafts = run_stepping(llm, PROMPTS, bound)
        assert outs == refs
        if method == "ngram":
            assert llm.stats()["num_accepted_draft_tokens"] > 0
        runs.append((most, drafts))
        llm.close()
    (most, drafts), (most_kept, drafts_kept) = runs
    assert most < most_kept
    assert drafts == drafts_kept


def test_second_request_runs_in_released_blocks(sliding):
    """A pool of just the blocks one max_model_len request needs runs two long requests
    side by side, with more positions between them than the pool has slots, and never
    preempts: each runs in blocks the other released."""
    path, _, refs = sliding
    max_len = len(PROMPTS[1]) + NEW_TOKENS + 1
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=BLOCK,
              max_model_len=max_len, num_kv_blocks=-(-(max_len + 1) // BLOCK))
    outs, _, overlapped, _ = run_stepping(llm, PROMPTS, held_bound(0, False, len(PROMPTS[1])))
    assert outs == refs
    assert overlapped
    assert llm.stats()["num_preemptions"] == 0
    llm.close()


@pytest.mark.parametrize("method", [None, "ngram"])
def test_pool_smaller_than_one_request(sliding, method):
    """On a sliding target the pool need only hold one request's window and a step's
    tokens (kv_cache.window_blocks), not max_model_len: with 8-token prefill chunks a
    pool of a fifth of one request's length runs two such requests to the end (the newer
    one preempted while the older needs the blocks) equal to transformers; a pool one
    block smaller is refused by name."""
    path, _, refs = sliding
    sc = NGramConfig(max_draft_len=3) if method else None
    k = 3 if method else 0
    need = -(-(WINDOW + max(8, slots_per_step(k, False) + k + 1)) // BLOCK) + 1
    max_len = len(PROMPTS[1]) + NEW_TOKENS + 1
    assert need * 4 < max_len // BLOCK
    kw = dict(dtype="float32", device=TEST_DEVICE, block_size=BLOCK, max_model_len=max_len,
              max_num_tokens=8, speculative_config=sc)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(path, num_kv_blocks=need - 1, **kw)
    llm = LLM(path, num_kv_blocks=need, **kw)
    outs, _, _, _ = run_stepping(llm, PROMPTS, need)
    assert outs == refs
    assert llm.stats()["num_preemptions"] > 0          # the pool was contended
    llm.close()


def test_preempted_and_prefix_cached_requests(sliding):
    """A request preempted after releasing blocks recomputes from position 0 in fresh
    blocks; a prompt found in the prefix cache (its blocks behind the window parked when
    the first request released them) takes only the cached blocks within its window (those
    behind it stay parked, their entries released): both equal transformers."""
    path, _, refs = sliding
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=BLOCK, max_model_len=128,
              num_kv_blocks=-(-130 // BLOCK), cuda_graphs=False)     # (no step in flight)
    eng = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    first = eng.add_request(PROMPTS[1], params)
    while first.num_computed < 60:
        eng.step()
    assert first.released_blocks > 0
    eng.scheduler._preempt(first)                 # as when the pool runs dry
    assert first.block_table == [] and first.released_blocks == 0
    while eng.has_unfinished():
        eng.step()
    assert first.output_token_ids == refs[1]
    again = eng.add_request(PROMPTS[1], params)
    eng.step()
    assert again.metrics.num_cached_tokens > WINDOW
    assert again.released_blocks > 0
    behind = again.prefix_chain[:again.released_blocks]
    assert all(eng.pool.cache.is_parked(rec.block_id) for rec in behind)
    assert again.block_table[:again.released_blocks] == [eng.pool.released] * len(behind)
    while eng.has_unfinished():
        eng.step()
    assert again.output_token_ids == refs[1]
    assert_pool_full(llm)
    llm.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.inference_mode()
def test_attention_never_reads_released_entries(backend):
    """Block-table entries behind every row's window that name the scratch block (a
    released block) leave both attention backends' output as it is with the request's own
    blocks there: the Triton kernel loads no key before its rows' window (the scratch block
    is NaN here to prove it); the portable path gathers the scratch block's finite values
    under a mask that weighs them 0. A decode row, a 4-row verify and a 6-row chunk."""
    if backend == "triton":
        pytest.importorskip("triton")
    from onespec.layers.attention import build_attention_metadata
    from onespec.layers.ops import TORCH_OPS, make_ops
    from onespec.kernels.settings import KernelSettings
    ops = TORCH_OPS if backend == "torch" else make_ops(KernelSettings(triton=True))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    num_blocks, heads, kv_heads, dim, window = 48, 4, 2, 32, 11
    scratch = num_blocks
    kc = torch.randn(((num_blocks + 1) * BLOCK, kv_heads, dim), generator=g, device=dev)
    vc = torch.randn(((num_blocks + 1) * BLOCK, kv_heads, dim), generator=g, device=dev)
    fill = float("nan") if backend == "triton" else 1e4
    kc[scratch * BLOCK:], vc[scratch * BLOCK:] = fill, fill
    q_lens, starts = [1, 4, 6], [37, 50, 29]
    perm = torch.randperm(num_blocks, generator=g, device=dev)
    tables = perm[:45].view(3, 15).clone()
    released = tables.clone()
    for r, start in enumerate(starts):
        released[r, :max(0, start - window + 1) // BLOCK] = scratch
    positions = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, q_lens)])
    q = torch.randn((positions.numel(), heads, dim), generator=g, device=dev)
    outs = []
    for t in (tables, released):
        meta = build_attention_metadata(t, q_lens, positions, BLOCK, int(positions.max()) + 1,
                                        window, backend)
        outs.append(ops.cached_attention(q, kc, vc, meta, dim ** -0.5))
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
