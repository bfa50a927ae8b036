"""Paged attention for CUDA in Triton: reads keys/values straight from the block pool.

One program per (query row, kv head) handles the kv head's group of query heads, walks the
row's visible key positions [max(0, pos - window + 1), pos] in tiles of BLOCK_N through the
request's block table, and keeps an online softmax (started from the head's sink logit, a
key of value zero, where the launch has sinks). Prefill chunks, K+1 verify rows and
single-token draft rows are all just rows with a request index and a position, so one
kernel serves all three, and its metadata is built on the device (CUDA-graph safe).

Decode-sized launches (at most MAX_SPLIT_ROWS rows) split each row's keys over up to SPLITS
programs, as many as keep the launch within split_programs (flash-decoding; batch 1 of the
8B shape: 32, batch 8: 4): split s takes key tiles s, s + SPLITS, ..., stores its partial
softmax state, and the last split to finish (an atomic ticket per row and kv head) merges
the partials in split order. A batch-1 decode step thus runs 8 x 32 programs instead of 8;
with 16-bit keys its tiles hold 128 keys, so up to 128 positions split 0 holds them all
(its result is stored as is, no merge) and the other splits leave at once.
When every request has the same number of consecutive rows (a K+1-row verify), a request's
rows can share one program per kv head and read each key tile once (rows_per_request);
where they overflow the tile (a 32-node tree's 33 rows), programs take the largest
divisor of them that fits.
Such launches of more rows split too when their programs would not fill the GPU (a K = 3
verify of 8 requests packs into 8 x 8 programs; at 16k keys each would walk all of them):
into the largest power of two of splits, at most SPLITS, that keeps the programs within
split_programs (default two per SM).
Launches with a prefill chunk (a request of more than MAX_SPLIT_ROWS rows) cut each
request's rows into packs (row_packs), one a program, which reads each key tile once for
its pack.
Tiles sit at multiples of BLOCK_N and rows without a visible key in a tile or split add
exact zeros, so a row's result depends only on its own keys, never on the other rows of
the batch or its pack.

Under programmatic dependent launch the kernel starts while the rotary kernel before it
writes this step's keys; when the rows per request are known, the only keys that kernel
writes are at the rows' own positions, so the first tile's older keys (and the positions
and block tables, inputs of the step) are read before waiting for it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from onespec.kernels.launch import INTERPRETED, pdl_launch, pdl_start

NO_WINDOW = 1 << 30
MAX_SPLIT_ROWS = 16     # launches of up to this many rows split their keys
SPLITS = 32
# decode-sized launches, and launches of more rows where every request has a few (decode
# steps and verifies of larger batches), 16-bit keys of head_dim <= 128: 128-key tiles,
# 4 warps, two stages, so a program loads its next tile while it works on this one and two
# programs share an SM. With one stage of 256-key tiles at 8 warps (one program an SM)
# split loads stall at long contexts (H100, 8B shape, one layer: batch 1 at 64k keys
# 96.5 us with 32 splits vs 126.5 us; batch 8 at 16k, 4 splits, 181 vs 241 us; at 1k keys
# 6.1 vs 6.3 us); the prefill tiling took 27.2 us a layer at batch 32 against 15.8 (H200).
ROWS_CONFIG = (128, 4, 2)
# launches without splits pack a request's rows into a tile of up to this many (row,
# query head) rows, read each key tile once for all of them: a K = 5 verify's 6 rows x 4
# query heads of a Llama-3 kv group take one 32-row tile instead of six 16-row ones, each
# reading every key again. Split launches pack only into the 16-row tile one row uses.
PACK_TILE_ROWS = 32
# prefill chunks (some request with more than MAX_SPLIT_ROWS rows): a request's consecutive
# rows pack into tiles of this many (row, query head) rows, 32 rows of a Llama-3 kv group,
# so each key tile is read once for all of them, not once a row (a 16k-token prompt of the
# 8B shape: 763 ms to its first token on an H100 against 3,704 with a program a row).
# 64-key tiles keep the [128, 64] logits and the [128, D] accumulator in registers at 8
# warps (230 registers, no spills, on sm_90).
PREFILL_TILE_ROWS = 128
PREFILL_CONFIG = (64, 8, 3)
PROGRAMS_PER_SM = 2          # launches of uniform rows split up to this many programs an SM
# the last split's unrolled merge holds every split's partial rows in registers: splits x
# merged rows stay within this. A decode row's 4 query heads of the 8B shape split 32 ways,
# a K = 3 verify's 4 rows x 4 heads 16 (H100, 16k keys: a K = 3 step of one request took
# 7.97 ms with its verify split 32 ways, 7.70 with 16)
MERGE_SPLIT_ROWS = 256
_tickets: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []     # smaller counters captured graphs may still use


def _ticket_counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (pack of rows, kv head); each launch leaves them zero.
    One buffer per device (16 rows x 256 kv heads), so CUDA graphs keep pointing at it;
    one outgrown is kept alive for the graphs captured with it."""
    t = _tickets.get(device)
    if t is None or t.numel() < n:
        if t is not None:
            _outgrown.append(t)
        t = _tickets[device] = torch.zeros(max(n, MAX_SPLIT_ROWS * 256), dtype=torch.int32,
                                           device=device)
    return t


def counters_clear(device) -> bool:
    """Whether the launches on `device` (at least one) left its ticket counters zero."""
    t = _tickets.get(torch.device(device))
    return t is not None and not bool(t.any())


@triton.jit
def _first_tile(split, t_lo, SPLITS: tl.constexpr):
    """The first key tile >= t_lo that belongs to `split` (tiles t with t % SPLITS == split)."""
    return t_lo + (split - t_lo % SPLITS + SPLITS) % SPLITS


@triton.jit
def _tile_rows(pack, kv_head, g, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """The query row and head of tile rows g: row g // GROUP of the pack, head g % GROUP
    of the kv head's group."""
    return pack * ROWS + g // GROUP, kv_head * GROUP + g % GROUP


@triton.jit
def _tile_offsets(BLOCK_TABLES, req, stride_bt, t, lo_min, pos_max, kv_head, stride_ct,
                  stride_ch, d, d_ok, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile t of request req: positions n [N] and the cache offsets of their
    (n, kv_head) rows [N, D], with the mask of the keys any row may see."""
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n <= pos_max) & (n >= lo_min)
    block = tl.load(BLOCK_TABLES + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    kv_off = slot[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
    return n, kv_off, n_ok[:, None] & d_ok[None, :]


@triton.jit
def _tree_visible(visible, n, row, row_ok, base, TREE_MASK, stride_tm, tree_width):
    """visible [G, N] narrowed to the tree: a row's keys at positions base .. base + width - 1
    (its request's tree block) count only where its mask byte for the key is set; keys
    outside the block keep the causal rule."""
    rel = n[None, :] - base[:, None]                                # [G, N]
    inside = (rel >= 0) & (rel < tree_width)
    bit = tl.load(TREE_MASK + row[:, None] * stride_tm + rel,
                  mask=inside & visible & row_ok[:, None], other=0)
    return visible & ((bit != 0) | (inside == 0))


@triton.jit
def _attend_tile(q, k, v, n, pos, lo, scale, m, l, acc, IEEE: tl.constexpr, TREE: tl.constexpr,
                 TREE_MASK, row, row_ok, base, stride_tm, tree_width):
    """One key tile's step of the online softmax for the rows' query heads [G, D]; with
    TREE, the keys in each row's tree block are masked by its ancestors (_tree_visible)."""
    if IEEE:   # float32, or Triton's interpreter (whose bf16 dot is wrong)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    visible = (n[None, :] <= pos[:, None]) & (n[None, :] >= lo[:, None])
    if TREE:
        visible = _tree_visible(visible, n, row, row_ok, base, TREE_MASK, stride_tm,
                                tree_width)
    return _softmax_step(s, visible, v, scale, m, l, acc, IEEE)


@triton.jit
def _softmax_step(s, visible, v, scale, m, l, acc, IEEE: tl.constexpr):
    """The online softmax state after a key tile's scores s over its `visible` keys [G, N]."""
    s = tl.where(visible, s * scale, float("-inf"))                # [G, N]
    m_new = tl.maximum(m, tl.max(s, 1))
    # a row with no visible key yet keeps exact zeros (no -inf - -inf)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _paged_attention_kernel(
        Q, K_CACHE, V_CACHE, BLOCK_TABLES, TOKEN_REQ, POSITIONS, OUT, PART_O, PART_ML, TICKETS,
        TREE_MASK, TREE_BASE, ROW_PACKS, SINKS,
        stride_qt, stride_qh, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
        stride_tm, scale, window, num_kv_heads, tree_width, v_scale,
        GROUP: tl.constexpr, ROWS: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, RPR: tl.constexpr,
        RPR_PAD: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        MERGE_ROWS: tl.constexpr = 16, TREE: tl.constexpr = False,
        VARLEN: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
        KV_FP8: tl.constexpr = False):
    if RPR == 0:
        pdl_start(PDL)    # nothing known about the rows: wait for the previous kernel first
    pack = tl.program_id(0)           # ROWS consecutive rows of one request
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # one tile row per (row of the pack, query head of the kv head's group)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    if VARLEN:      # up to ROWS rows of one request from ROW_PACKS: (first row, count)
        first = tl.load(ROW_PACKS + 2 * pack)
        g_ok = g < tl.load(ROW_PACKS + 2 * pack + 1) * GROUP
        row, head = _tile_rows(first, kv_head, g, 1, GROUP)
    else:
        first = pack * ROWS
        g_ok = g < ROWS * GROUP
        row, head = _tile_rows(pack, kv_head, g, ROWS, GROUP)
    req = tl.load(TOKEN_REQ + first)
    pos = tl.load(POSITIONS + row, mask=g_ok, other=0)                  # [G]
    lo = tl.maximum(pos - window + 1, 0)
    pos_max = tl.max(pos, 0)
    lo_min = tl.min(tl.where(g_ok, lo, pos_max), 0)
    # key tiles at multiples of BLOCK_N, so a row sees the same tiles (and splits) in any
    # pack; this split's: t = split, split + SPLITS, ... (all of them when SPLITS == 1)
    t_lo = lo_min // BLOCK_N
    t_hi = pos_max // BLOCK_N
    t0 = _first_tile(split, t_lo, SPLITS)
    # A split without a key tile leaves at once (it writes nothing, takes no ticket): with
    # the rows known before its PDL wait, it frees its SM slot while the qkv kernel still
    # runs, and the successor's launch waits only for the splits that work.
    if t0 > t_hi:
        return
    n, kv_off, kv_mask = _tile_offsets(BLOCK_TABLES, req, stride_bt, t0, lo_min, pos_max,
                                       kv_head, stride_ct, stride_ch, d, d_ok, BLOCK_SIZE,
                                       BLOCK_N)
    rows_mask = g_ok[:, None] & d_ok[None, :]          # the tile's real (row, head) rows
    if RPR > 0:
        # Each request has RPR rows, and the only keys the previous kernel (rotary + KV
        # write) writes are at their positions (`mine`): the others of the first tile (and
        # the step's inputs) are read while it still runs.
        r = tl.arange(0, RPR_PAD)
        mine = tl.load(POSITIONS + (pack * ROWS) // RPR * RPR + r, mask=r < RPR, other=-1)
        is_mine = tl.max(((n[:, None] == mine[None, :]) & (r < RPR)[None, :]).to(tl.int32), 1)
        old, new = kv_mask & (is_mine == 0)[:, None], kv_mask & (is_mine != 0)[:, None]
        k = tl.load(K_CACHE + kv_off, mask=old, other=0.0)
        v = tl.load(V_CACHE + kv_off, mask=old, other=0.0)
        pdl_start(PDL)
        k = tl.load(K_CACHE + kv_off, mask=new, other=k)
        v = tl.load(V_CACHE + kv_off, mask=new, other=v)
    else:
        k = tl.load(K_CACHE + kv_off, mask=kv_mask, other=0.0)          # [N, D]
        v = tl.load(V_CACHE + kv_off, mask=kv_mask, other=0.0)
    # an e4m3 cache's tiles in the queries' dtype (exact; a no-op for a 16-bit cache): its
    # k_scale is folded into `scale` by the launch, its v_scale applied to the result
    dt = Q.dtype.element_ty
    k = k.to(dt)
    v = v.to(dt)
    q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rows_mask, other=0.0)                              # [G, D]
    if HAS_SINKS:
        # the head's sink is one more key of logit SINKS[head] and value 0: the state starts
        # from it in the split holding the first key tile (once per row, whatever the split)
        has_sink = tl.where(t0 == t_lo, g_ok, False)
        m = tl.load(SINKS + head, mask=has_sink, other=float("-inf")).to(tl.float32)
        l = tl.where(has_sink, 1.0, 0.0)
    else:
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    if TREE:   # after the PDL wait: the rows' tree blocks (an input of the step)
        base = tl.load(TREE_BASE + row, mask=g_ok, other=0)            # [G]
    else:
        base = pos
    m, l, acc = _attend_tile(q, k, v, n, pos, lo, scale, m, l, acc, IEEE, TREE, TREE_MASK,
                             row, g_ok, base, stride_tm, tree_width)
    for t in range(t0 + SPLITS, t_hi + 1, SPLITS):
        n, kv_off, kv_mask = _tile_offsets(BLOCK_TABLES, req, stride_bt, t, lo_min, pos_max,
                                           kv_head, stride_ct, stride_ch, d, d_ok, BLOCK_SIZE,
                                           BLOCK_N)
        k = tl.load(K_CACHE + kv_off, mask=kv_mask, other=0.0).to(dt)
        v = tl.load(V_CACHE + kv_off, mask=kv_mask, other=0.0).to(dt)
        m, l, acc = _attend_tile(q, k, v, n, pos, lo, scale, m, l, acc, IEEE, TREE,
                                 TREE_MASK, row, g_ok, base, stride_tm, tree_width)
    if KV_FP8:
        acc = acc * v_scale           # (the sum is linear in the values; splits merge it)
    out_ptrs = OUT + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLITS == 1:
        _store_normalised(out_ptrs, acc, l, rows_mask)
    else:
        # the merge holds only the real rows (fewer registers a split, so the loads of
        # every split can be in flight together)
        gm = tl.arange(0, MERGE_ROWS)
        gm_ok = gm < ROWS * GROUP
        m_row, m_head = _tile_rows(pack, kv_head, gm, ROWS, GROUP)
        merge_ptrs = OUT + m_row[:, None] * stride_ot + m_head[:, None] * stride_oh + d[None, :]
        _merge_splits(acc, m, l, PART_O, PART_ML, TICKETS, out_ptrs, rows_mask, merge_ptrs,
                      gm_ok[:, None] & d_ok[None, :], t_lo, t_hi,
                      pack * num_kv_heads + kv_head, split, g, g_ok, gm, gm_ok, d, GROUP_PAD,
                      DIM_PAD, MERGE_ROWS, SPLITS)


@triton.jit
def _store_normalised(out_ptrs, acc, l, out_mask):
    """The rows' attention output acc / l (l = 0 on padding rows of the tile: no 0/0)."""
    l = tl.where(l > 0, l, 1.0)
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits(acc, m, l, PART_O, PART_ML, TICKETS, out_ptrs, out_mask, merge_ptrs,
                  merge_mask, t_lo, t_hi, unit, split, g, g_ok, gm, gm_ok, d,
                  GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr,
                  SPLITS: tl.constexpr, UNROLL: tl.constexpr = True):
    """Store this split's (acc, m, l); the last of the unit's splits with keys to arrive
    merges them all in split order (the same arithmetic whichever program comes last;
    a split with no key visible to a row adds exact zeros to it). Splits without keys
    leave at once; keys within one tile need no merge. Only the tile's real rows are
    stored (g_ok) and merged (the first MERGE_ROWS rows; merge_ptrs, merge_mask).

    UNROLL: the merge loop is unrolled and each split's loads are predicated rather than
    branched over, so they are all in flight at once (one L2 round trip for the partials
    instead of one per split); a split without keys leaves the state as it is. Wide
    partials (MLA's 512-wide latents: SPLITS x 32 KB a program) would not fit in registers
    unrolled: there the loop loads one split at a time."""
    if _first_tile(split, t_lo, SPLITS) > t_hi:
        return
    if t_hi == t_lo:
        # one split holds every key: its result as is (what merging it alone would give)
        _store_normalised(out_ptrs, acc, l, out_mask)
        return
    base = unit * SPLITS
    tl.store(PART_O + ((base + split) * GROUP_PAD + g[:, None]) * DIM_PAD + d[None, :], acc,
             mask=out_mask)
    tl.store(PART_ML + ((base + split) * 2) * GROUP_PAD + g, m, mask=g_ok)
    tl.store(PART_ML + ((base + split) * 2 + 1) * GROUP_PAD + g, l, mask=g_ok)
    # release: the partials above are visible to whoever draws the last ticket (acquire)
    ticket = tl.atomic_add(TICKETS + unit, 1, sem="acq_rel")
    if ticket == tl.minimum(t_hi - t_lo + 1, SPLITS) - 1:
        tl.store(TICKETS + unit, 0)                     # ready for the next launch
        m_all = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
        l_all = tl.zeros([MERGE_ROWS], tl.float32)
        o_all = tl.zeros([MERGE_ROWS, DIM_PAD], tl.float32)
        if UNROLL:
            for s in tl.static_range(SPLITS):
                m_all, l_all, o_all = _merge_split(m_all, l_all, o_all, PART_O, PART_ML,
                                                   base, s, t_lo, t_hi, gm, gm_ok, d,
                                                   merge_mask, GROUP_PAD, DIM_PAD, SPLITS)
        else:
            for s in range(SPLITS):
                m_all, l_all, o_all = _merge_split(m_all, l_all, o_all, PART_O, PART_ML,
                                                   base, s, t_lo, t_hi, gm, gm_ok, d,
                                                   merge_mask, GROUP_PAD, DIM_PAD, SPLITS)
        _store_normalised(merge_ptrs, o_all, l_all, merge_mask)


@triton.jit
def _merge_split(m_all, l_all, o_all, PART_O, PART_ML, base, s, t_lo, t_hi, g, g_ok, d,
                 mask, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr):
    """The running merge after split s's stored state (unchanged if s has no keys)."""
    has = _first_tile(s, t_lo, SPLITS) <= t_hi
    o_s, m_s, l_s = _load_partial(PART_O, PART_ML, base + s, g, g_ok, d, mask, has,
                                  GROUP_PAD, DIM_PAD)
    m_new, l_new, o_new = _merge_one(m_all, l_all, o_all, m_s, l_s, o_s)
    return (tl.where(has, m_new, m_all), tl.where(has, l_new, l_all),
            tl.where(has, o_new, o_all))


@triton.jit
def _load_partial(PART_O, PART_ML, slot, g, g_ok, d, mask, has, GROUP_PAD: tl.constexpr,
                  DIM_PAD: tl.constexpr):
    """One split's stored (acc, m, l) of rows g, from L2 (other programs wrote it), if
    `has`. (tl.where, not `&`: Triton's interpreter rejects a scalar anded with a tensor.)"""
    o_s = tl.load(PART_O + (slot * GROUP_PAD + g[:, None]) * DIM_PAD + d[None, :],
                  mask=tl.where(has, mask, False), other=0.0, cache_modifier=".cg")
    rows_ok = tl.where(has, g_ok, False)
    m_s = tl.load(PART_ML + (slot * 2) * GROUP_PAD + g, mask=rows_ok, other=float("-inf"),
                  cache_modifier=".cg")
    l_s = tl.load(PART_ML + (slot * 2 + 1) * GROUP_PAD + g, mask=rows_ok, other=0.0,
                  cache_modifier=".cg")
    return o_s, m_s, l_s


@triton.jit
def _merge_one(m_all, l_all, o_all, m_s, l_s, o_s):
    """The running merge's state after one more split's partial softmax state."""
    m_new = tl.maximum(m_all, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m_all - m_safe)
    b = tl.exp(m_s - m_safe)
    return m_new, l_all * a + l_s * b, o_all * a[:, None] + o_s * b[:, None]


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H200's 132 elsewhere: the
    interpreter runs the launch a GPU would)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_per_program(rpr: int, group: int, limit: int) -> int:
    """Rows of a request one program takes: the largest divisor of rpr whose (row, query
    head) rows fit `limit` tile rows (all rpr where they fit; a 32-node tree's 33 verify
    rows of a Llama-3 kv group of 4 heads: 3, so each key tile is read 11 times, not 33)."""
    if rpr <= 1:
        return 1
    return max(p for p in range(1, rpr + 1) if rpr % p == 0 and p * group <= max(limit, group))


def num_splits(num_rows: int, rpr: int, units: int, splits: int,
                split_programs: int, merge_rows: int = 1) -> int:
    """Splits of a launch: for decode-sized launches and for launches of more uniform rows
    (0 < rpr <= MAX_SPLIT_ROWS), the largest power of two <= splits keeping units x
    splits within split_programs (at least 1 for decode-sized ones: a batch of 8 at 16k
    keys runs 256 programs of 32 key tiles, not 2048 of 4 and their merges) and splits x
    merge_rows (a program's merged rows, a power of two) within MERGE_SPLIT_ROWS; for
    uniform launches whose units already fill the GPU, and prefill chunks, 1.
    split_programs 0: decode-sized launches take `splits` (within MERGE_SPLIT_ROWS),
    others 1."""
    fit = 1 << max(split_programs // max(units, 1), 1).bit_length() - 1
    splits = min(splits, max(MERGE_SPLIT_ROWS // merge_rows, 1))
    if num_rows <= MAX_SPLIT_ROWS:
        return min(splits, fit) if split_programs > 0 else splits
    if not 0 < rpr <= MAX_SPLIT_ROWS or units * 2 > split_programs:
        return 1
    return min(splits, fit)


def prefill_pack_rows(group: int, head_dim: int, dtype: torch.dtype) -> int:
    """Rows of a request one prefill program takes (see row_packs), for `group` query heads
    a kv head: PREFILL_TILE_ROWS tile rows (half for float32 or heads wider than 128)."""
    tile = PREFILL_TILE_ROWS if wide_tiles(head_dim, dtype) else PREFILL_TILE_ROWS // 2
    return max(tile // triton.next_power_of_2(group), 1)


def row_packs(q_lens, rows: int, device) -> torch.Tensor | None:
    """[P, 2] int32 (first row, row count) cutting each request's consecutive rows (q_lens,
    in order) into packs of up to `rows`, a request's last pack (its latest positions, the
    most keys) first so the longest programs start first; None where no request has more
    than MAX_SPLIT_ROWS rows (decode and verify launches keep their own packing)."""
    if not q_lens or max(q_lens) <= MAX_SPLIT_ROWS:
        return None
    packs, start = [], 0
    for n in q_lens:
        packs += [(s, min(rows, start + n - s)) for s in range(start, start + n, rows)][::-1]
        start += n
    return torch.tensor(packs, dtype=torch.int32).to(device, non_blocking=True)


def wide_tiles(head_dim: int, dtype: torch.dtype) -> bool:
    """16-bit heads of up to 128: the wide tilings (float32 tiles need twice the smem)."""
    return head_dim <= 128 and dtype.itemsize <= 2


def paged_attention(q, k_cache, v_cache, block_tables, token_req, positions, scale: float,
                    block_size: int, window: int | None = None, *,
                    rows_per_request: int = 0, pdl: bool = False,
                    config: tuple[int, int, int] | None = None, splits: int = SPLITS,
                    pack_tile_rows: int = PACK_TILE_ROWS, split_programs: int | None = None,
                    tree_mask: torch.Tensor | None = None,
                    tree_base: torch.Tensor | None = None,
                    packs: Callable[[int], torch.Tensor | None] | None = None,
                    sinks: torch.Tensor | None = None,
                    kv_scales: tuple[float, float] | None = None):
    """q [T, Hq, D]; caches [slots, Hkv, D]; block_tables [B, nb]; token_req/positions [T].
    Returns [T, Hq, D]. Keys for the rows' own positions must already be in the cache.
    pdl: launch with programmatic dependent launch. config: (BLOCK_N, num_warps,
    num_stages) instead of the default; splits, pack_tile_rows: instead of SPLITS and
    PACK_TILE_ROWS; split_programs: the programs a launch of more than MAX_SPLIT_ROWS
    uniform rows may split into, instead of PROGRAMS_PER_SM a SM (0: never split them;
    benchmarks and tests).

    rows_per_request (0: not known): every request has this many consecutive rows (1 for a
    decode step, K+1 for a verify). Then (a) a request's rows share programs and read each
    key tile once, while they fit the tile of query rows a single row uses (so each row's
    arithmetic stays the same) in split launches, or pack_tile_rows rows in others; (b)
    the keys at the rows' own positions are the only ones the kernel just before (rotary +
    KV write) may write: under PDL the other keys of the first tile, positions and block
    tables are read before waiting for it.

    tree_mask [T, W] (bool or int8) with tree_base [T] (dynamic trees): row r sees a key
    at position j in tree_base[r] .. tree_base[r] + W - 1 only if tree_mask[r, j -
    tree_base[r]] is set (its ancestors in a tree block); keys outside that block keep the
    causal (and window) rule. Without them the kernel has no tree code.

    packs (launches without splits or rows_per_request): packs(rows) gives the launch's
    row_packs of up to `rows` rows (AttentionMetadata.row_packs), or None; each program
    then takes one pack, reading each key tile once for its rows. A row's result does not
    depend on its pack (as above).

    sinks [Hq] (gpt-oss's attention sinks): each head's softmax has one more logit,
    sinks[h], whose value is zero: the weights on the keys sum to less than one.

    kv_scales (k_scale, v_scale): the caches are e4m3 (kv_cache_dtype="fp8"); key and value
    tiles are converted to q's dtype as they are loaded (exact), k_scale multiplies the
    softmax scale and v_scale the result (the same sums as dequantizing each key and value
    first, rounded differently)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    rpr = rows_per_request if rows_per_request > 0 and num_rows % rows_per_request == 0 else 0
    if num_rows == 0:
        return out
    group_pad = max(16, triton.next_power_of_2(group))
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if split_programs is None:
        split_programs = PROGRAMS_PER_SM * _sm_count(q.device)
    # split launches pack only into the tile one row uses
    split_pack = rows_per_program(rpr, group, group_pad)
    units = num_rows // split_pack * num_kv_heads
    splits = num_splits(num_rows, rpr, units, splits, split_programs,
                         triton.next_power_of_2(split_pack * group))
    pack_rows = prefill_pack_rows(group, head_dim, q.dtype)
    pack_table = packs(pack_rows) if packs is not None and splits == 1 and rpr == 0 else None
    varlen = pack_table is not None
    if config is None:
        # other rows of unknown count: 256-key tiles (swept on an H200 for prefill chunks
        # before they packed: at 256..1024 positions 5.5..17 us per 8B-shape layer vs
        # 8.6..32 with 64)
        wide = wide_tiles(head_dim, q.dtype)
        narrow = 64 if head_dim <= 128 else 32
        if varlen:
            config = PREFILL_CONFIG if wide else (32, 4, 2)
        elif (splits > 1 and num_rows <= MAX_SPLIT_ROWS) or 0 < rpr <= MAX_SPLIT_ROWS:
            config = ROWS_CONFIG if wide else (narrow, 4, 2)
        else:
            config = (256, 8, 3) if wide else (narrow, 4, 3)
    block_n, warps, stages = config
    if varlen:
        pack = pack_rows
    else:
        pack = split_pack if splits > 1 else rows_per_program(rpr, group, max(group_pad, pack_tile_rows))
    group_pad = max(group_pad, triton.next_power_of_2(pack * group))
    units = (pack_table.shape[0] if varlen else num_rows // pack) * num_kv_heads
    if splits > 1:       # per (row, kv head, split): acc [G, D] and (m, l) [2, G], float32
        part_o = torch.empty(units * splits * group_pad * dim_pad, dtype=torch.float32,
                             device=q.device)
        part_ml = torch.empty(units * splits * 2 * group_pad, dtype=torch.float32,
                              device=q.device)
        tickets = _ticket_counters(q.device, units)
    else:
        part_o = part_ml = tickets = out
    tree = tree_mask is not None
    if tree:
        tree_mask = tree_mask.to(torch.int8).contiguous()
        tree_base = tree_base.to(positions.dtype)
    grid = (units // num_kv_heads, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, token_req, positions, out, part_o, part_ml, tickets,
        tree_mask if tree else out, tree_base if tree else positions,
        pack_table if varlen else positions,
        sinks.float().contiguous() if sinks is not None else out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        tree_mask.stride(0) if tree else 0, scale * (kv_scales[0] if kv_scales else 1.0),
        window or NO_WINDOW, num_kv_heads, tree_mask.shape[1] if tree else 0,
        kv_scales[1] if kv_scales else 1.0,
        GROUP=group, ROWS=pack, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLITS=splits,
        RPR=rpr, RPR_PAD=triton.next_power_of_2(max(rpr, 1)),
        IEEE=q.dtype == torch.float32 or INTERPRETED, PDL=pdl,
        MERGE_ROWS=triton.next_power_of_2(pack * group), TREE=tree, VARLEN=varlen,
        HAS_SINKS=sinks is not None, KV_FP8=kv_scales is not None,
        num_warps=warps,
        num_stages=stages,
        **pdl_launch(pdl))
    return out
