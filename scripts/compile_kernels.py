"""Compiles onespec's Triton kernels ahead of time for an NVIDIA target, without a GPU.

    python scripts/compile_kernels.py [--arch 90] [--linear 32:256:8:4:4:0,...]

Each kernel is compiled in the configurations the engine launches on CUDA (bf16 decode,
fp32 as in the GPU tests; programmatic dependent launch on for sm_90+), through Triton's
own CUDA backend (LLVM + the bundled ptxas), so a change that breaks compilation for the
GPU, or needs more shared memory than an H100/H200 block may use, shows up on a CPU-only
machine. Prints one JSON line per kernel; exits 1 if any failed. Must run without
TRITON_INTERPRET (the interpreter replaces the kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SMEM_LIMIT = 232448            # bytes of shared memory one block may use on sm_90


def compile_one(fn, types: dict, constexprs: dict, arch: int, num_warps: int,
                num_stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "EARLY" in fn.arg_names:         # the successor released after the stream
        constexprs = {"EARLY": False, **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    # as the launcher specialises them: pointers and integer arguments 16-divisible
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and not sig[n].startswith("fp")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = kernel.asm["ptx"]
    before_wait = ptx.split("griddepcontrol.wait")[0]
    before_release = ptx.split("griddepcontrol.launch_dependents")[0]
    return {"shared_bytes": kernel.metadata.shared,
            "pdl_instructions": ptx.count("griddepcontrol"),
            "global_loads_before_wait": before_wait.count("ld.global"),
            "global_loads_before_release": before_release.count("ld.global")}


def cases(arch: int, extra_linear: list[tuple[int, ...]] = ()):
    import torch

    from onespec.kernels import attention as ta
    from onespec.kernels import gemv as gv
    from onespec.kernels import rope_kv as rk
    from onespec.kernels import rows as rw
    pdl = arch >= 90
    ptrs = {n: "*bf16" for n in ("X", "W", "BIAS", "RES", "Y", "NW_OUT", "XN_OUT")}
    ptrs.update(SS_IN="*fp32", SS_OUT="*fp32", ARG_VAL="*fp32", ARG_IDX="*i32", eps="fp32")
    linear = dict(BLOCK_P=1, HAS_BIAS=False, GATED=False, RESIDUAL=False, PRENORMED=False,
                  NORM_OUT=False, ARGMAX=False, IEEE=False, PDL=pdl, PRE=1, ROWS=16)
    gated_cfg, plain_cfg = gv.default_tiling(1, 1, True), gv.default_tiling(1, 1, False)
    yield ("gemv plain", gv._gemv_kernel, ptrs,
           {**linear, "BLOCK_N": plain_cfg[0], "BLOCK_K": plain_cfg[1]}, plain_cfg[2:])
    yield ("gemv prenorm", gv._gemv_kernel, ptrs,
           {**linear, "BLOCK_N": plain_cfg[0], "BLOCK_K": plain_cfg[1], "RESIDUAL": True,
            "NORM_OUT": True}, plain_cfg[2:])
    deep_cfg = gv.default_tiling(1, 1, False, True)
    yield ("gemv prenorm, square (o_proj) on sm_90", gv._gemv_kernel,
           ptrs, {**linear, "BLOCK_N": deep_cfg[0], "BLOCK_K": deep_cfg[1], "RESIDUAL": True,
                  "NORM_OUT": True}, deep_cfg[2:])
    # batch 32's decode step: 32-row tiles, the pipeline shortened to keep programs per SM
    stages32 = gv.stages_for_rows(deep_cfg[0], deep_cfg[1], deep_cfg[3], 32, 2, 2, SMEM_LIMIT)
    yield ("gemv prenorm, square (o_proj), 32-row tile",
           gv._gemv_kernel, ptrs,
           {**linear, "BLOCK_N": deep_cfg[0], "BLOCK_K": deep_cfg[1], "RESIDUAL": True,
            "NORM_OUT": True, "ROWS": 32}, (deep_cfg[2], stages32))
    down_cfg = gv.default_tiling(4096, 14336, False, True)     # the 8B shape's, on sm_90
    yield ("gemv prenorm, early release (down before qkv)",
           gv._gemv_kernel, ptrs,
           {**linear, "BLOCK_N": down_cfg[0], "BLOCK_K": down_cfg[1], "RESIDUAL": True,
            "NORM_OUT": True, "EARLY": True}, down_cfg[2:])
    yield ("gemv prenormed+gated+bias", gv._gemv_kernel, ptrs,
           {**linear, "BLOCK_N": gated_cfg[0], "BLOCK_K": gated_cfg[1], "GATED": True,
            "HAS_BIAS": True, "PRENORMED": True, "BLOCK_P": 128}, gated_cfg[2:])
    yield ("gemv fp32 logits", gv._gemv_kernel, {**ptrs, "Y": "*fp32"},
           {**linear, "BLOCK_N": plain_cfg[0], "BLOCK_K": plain_cfg[1]}, plain_cfg[2:])
    vocab_cfg = gv.default_tiling(128256, 4096, False, True)   # a vocabulary-sized lm_head
    yield ("gemv argmax", gv._gemv_kernel, {**ptrs, "Y": "*fp32"},
           {**linear, "BLOCK_N": vocab_cfg[0], "BLOCK_K": vocab_cfg[1], "ARGMAX": True},
           vocab_cfg[2:])
    for cfg in extra_linear:       # (BLOCK_N, BLOCK_K, warps, stages, PRE, gated)
        bn, bk, warps, stages, pre, gated = cfg
        yield (f"gemv {bn}:{bk}:{warps}:{stages}:{pre}{' gated' if gated else ''}",
               gv._gemv_kernel, ptrs,
               {**linear, "BLOCK_N": bn, "BLOCK_K": bk, "PRE": pre, "GATED": bool(gated),
                "RESIDUAL": not gated}, (warps, stages))
    qkv_cfg = gv.default_tiling(6144, 4096, False)
    qkv_types = {**ptrs, "COS_SIN": "*fp32", "POSITIONS": "*i64", "ROT_POS": "*i64",
                 "BLOCK_TABLES": "*i64", "TOKEN_REQ": "*i64", "Q_OUT": "*bf16",
                 "K_CACHE": "*bf16", "V_CACHE": "*bf16", "k_inv": "fp32", "v_inv": "fp32"}
    qkv = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "PAIRS": 16, "BLOCK_SIZE": 16,
           "BLOCK_K": qkv_cfg[1], "PRE": 1, "BLOCK_P": 128, "HAS_BIAS": False,
           "PRENORMED": True, "IEEE": False, "PDL": pdl, "ROWS": 16}
    yield ("qkv + rotary + KV write (prenormed)", rk._qkv_rope_kernel, qkv_types, qkv,
           qkv_cfg[2:])
    stages32 = gv.stages_for_rows(qkv_cfg[0], qkv_cfg[1], qkv_cfg[3], 32, 2, 2, SMEM_LIMIT)
    yield ("qkv + rotary + KV write (prenormed), 32-row tile", rk._qkv_rope_kernel,
           qkv_types, {**qkv, "ROWS": 32}, (qkv_cfg[2], stages32))
    yield ("qkv + rotary + e4m3 KV write (kv_cache_dtype='fp8')", rk._qkv_rope_kernel,
           {**qkv_types, "K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv"},
           {**qkv, "KV_FP8": True}, qkv_cfg[2:])
    yield ("argmax reduce", gv._argmax_reduce_kernel,
           {"VAL": "*fp32", "IDX": "*i32", "OFFSETS": "*i64", "OUT": "*i64"},
           {"BLOCK_P": 1024, "HAS_OFFSETS": True, "PDL": pdl},
           (4, 1))
    from onespec.kernels import fp8_gemv as f8
    bn, bk, warps, stages = f8.TILING
    f8_types = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "BIAS": "*bf16", "RES": "*bf16",
                "Y": "*bf16", "SS_IN": "*fp32", "eps": "fp32"}
    f8_cfg = {"BO": 1, "BI": 1, "BLOCKED": False, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_P": 1,
              "HAS_BIAS": False, "GATED": False, "RESIDUAL": False, "PRENORMED": False,
              "IEEE": False, "PDL": pdl, "ROWS": 16}
    yield ("fp8 gemv per channel, residual", f8._fp8_gemv_kernel, f8_types,
           {**f8_cfg, "RESIDUAL": True}, (warps, stages))
    yield ("fp8 gemv per 128 x 128 block, prenormed + gated", f8._fp8_gemv_kernel, f8_types,
           {**f8_cfg, "BO": 128, "BI": 128, "BLOCKED": True, "GATED": True,
            "PRENORMED": True, "BLOCK_P": 128}, (warps, stages))
    yield ("fp8 gemv per block, 32-row tile, fp32 logits", f8._fp8_gemv_kernel,
           {**f8_types, "Y": "*fp32"},
           {**f8_cfg, "BO": 128, "BI": 128, "BLOCKED": True, "ROWS": 32}, (warps, stages))
    yield ("gemv float32 (tests)", gv._gemv_kernel,
           {**{n: "*fp32" for n in ptrs if n.isupper()}, "ARG_IDX": "*i32", "eps": "fp32"},
           {**linear, "BLOCK_N": gated_cfg[0], "BLOCK_K": gated_cfg[1], "GATED": True,
            "IEEE": True}, gated_cfg[2:])
    yield ("rms_norm", rw._rms_norm_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16",
                                              "eps": "fp32"},
           {"BLOCK": 4096, "PDL": pdl}, (8, 3))
    yield ("residual add + rms_norm (rows beyond the decode kernels)",
           rw._add_rms_norm_kernel, {n: "*bf16" for n in ("Y", "RES", "W", "H", "XN")} |
           {"eps": "fp32"}, {"BLOCK": 4096, "PDL": pdl}, (8, 3))
    yield ("silu * up (rows beyond the decode kernels)", rw._silu_mul_kernel,
           {"Y": "*bf16", "OUT": "*bf16"}, {"BLOCK": 2048, "PDL": pdl}, (4, 3))
    yield ("embed + norms (EAGLE-3 input)", rw._embed_norm_concat_kernel,
           {"IDS": "*i64", "TABLE": "*bf16", "HID": "*bf16", "W_E": "*bf16", "W_H": "*bf16",
            "Y": "*bf16", "eps_e": "fp32", "eps_h": "fp32"}, {"BLOCK": 4096, "PDL": pdl}, (8, 3))
    rope = {n: "*bf16" for n in ("QKV", "Q_NORM_W", "K_NORM_W", "Q_OUT", "K_CACHE",
                                 "V_CACHE")}
    rope.update(COS_SIN="*fp32", POSITIONS="*i64", ROT_POS="*i64", BLOCK_TABLES="*i64",
                TOKEN_REQ="*i64", eps="fp32", k_inv="fp32", v_inv="fp32")
    yield ("rope_and_cache qk-norm", rk._rope_cache_kernel, rope,
           {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "BLOCK_SIZE": 16,
            "QK_NORM": True, "PDL": pdl},
           (1, 3))
    yield ("rope_and_cache qk-norm, e4m3 KV write", rk._rope_cache_kernel,
           {**rope, "K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv"},
           {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "BLOCK_SIZE": 16,
            "QK_NORM": True, "PDL": pdl, "KV_FP8": True},
           (1, 3))
    attn = {n: "*bf16" for n in ("Q", "K_CACHE", "V_CACHE", "OUT")}
    attn.update(BLOCK_TABLES="*i64", TOKEN_REQ="*i64", POSITIONS="*i64", PART_O="*fp32",
                PART_ML="*fp32", TICKETS="*i32", TREE_MASK="*i8", TREE_BASE="*i64",
                ROW_PACKS="*i32", SINKS="*fp32", scale="fp32",
                v_scale="fp32")
    base = {"GROUP": 4, "ROWS": 1, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128,
            "BLOCK_SIZE": 16, "RPR": 0, "RPR_PAD": 1, "PDL": pdl, "MERGE_ROWS": 4, "TREE": False}
    pre_n, pre_warps, pre_stages = ta.PREFILL_CONFIG
    pre_rows = ta.prefill_pack_rows(4, 128, torch.bfloat16)
    yield ("attention bf16 prefill", ta._paged_attention_kernel, attn,
           {**base, "ROWS": pre_rows, "GROUP_PAD": 4 * pre_rows, "BLOCK_N": pre_n,
            "SPLITS": 1, "IEEE": False, "VARLEN": True}, (pre_warps, pre_stages))
    yield ("attention bf16 rows without packs", ta._paged_attention_kernel, attn,
           {**base, "BLOCK_N": 256, "SPLITS": 1, "IEEE": False}, (8, 3))
    rows_n, rows_warps, rows_stages = ta.ROWS_CONFIG

    def capped(merge_rows):      # the splits of a launch whose programs merge these rows
        return ta.num_splits(1, 1, 1, ta.SPLITS, 0, merge_rows)
    yield ("attention bf16 decode (split keys, 4-row verify packs)",
           ta._paged_attention_kernel, attn,
           {**base, "ROWS": 4, "BLOCK_N": rows_n, "SPLITS": capped(16), "RPR": 4,
            "RPR_PAD": 4, "IEEE": False, "MERGE_ROWS": 16}, (rows_warps, rows_stages))
    yield ("attention bf16 decode (split keys, 1 row per request)",
           ta._paged_attention_kernel, attn,
           {**base, "BLOCK_N": rows_n, "SPLITS": capped(4), "RPR": 1,
            "IEEE": False}, (rows_warps, rows_stages))
    yield ("attention bf16 batched decode (4-row verify packs, no split)",
           ta._paged_attention_kernel, attn,
           {**base, "ROWS": 4, "BLOCK_N": rows_n, "SPLITS": 1, "RPR": 4, "RPR_PAD": 4,
            "IEEE": False, "MERGE_ROWS": 16}, (rows_warps, rows_stages))
    yield ("attention bf16 batched verify (6-row packs in a 32-row tile, no split)",
           ta._paged_attention_kernel, attn,
           {**base, "ROWS": 6, "GROUP_PAD": 32, "BLOCK_N": rows_n, "SPLITS": 1, "RPR": 6,
            "RPR_PAD": 8, "IEEE": False, "MERGE_ROWS": 32}, (rows_warps, rows_stages))
    yield ("attention bf16 tree verify (split keys, 8-row packs, ancestor masks)",
           ta._paged_attention_kernel, attn,
           {**base, "ROWS": 8, "GROUP_PAD": 32, "BLOCK_N": rows_n, "SPLITS": capped(32),
            "RPR": 8, "RPR_PAD": 8, "IEEE": False, "MERGE_ROWS": 32, "TREE": True},
           (rows_warps, rows_stages))
    yield ("attention bf16 tree verify (no split, ancestor masks)",
           ta._paged_attention_kernel, attn,
           {**base, "BLOCK_N": 256, "SPLITS": 1, "IEEE": False, "TREE": True}, (8, 3))
    yield ("attention bf16 decode with sinks (gpt-oss, split keys, 1 row per request)",
           ta._paged_attention_kernel, attn,
           {**base, "GROUP": 8, "GROUP_PAD": 16, "HEAD_DIM": 64, "DIM_PAD": 64,
            "BLOCK_N": rows_n, "SPLITS": capped(4), "RPR": 1, "IEEE": False,
            "HAS_SINKS": True}, (rows_warps, rows_stages))
    fp8_kv = {**attn, "K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv"}
    yield ("attention bf16 decode over an e4m3 cache (split keys, 4-row verify packs)",
           ta._paged_attention_kernel, fp8_kv,
           {**base, "ROWS": 4, "BLOCK_N": rows_n, "SPLITS": capped(16), "RPR": 4,
            "RPR_PAD": 4, "IEEE": False, "MERGE_ROWS": 16, "KV_FP8": True},
           (rows_warps, rows_stages))
    yield ("attention bf16 prefill over an e4m3 cache", ta._paged_attention_kernel, fp8_kv,
           {**base, "ROWS": pre_rows, "GROUP_PAD": 4 * pre_rows, "BLOCK_N": pre_n,
            "SPLITS": 1, "IEEE": False, "VARLEN": True, "KV_FP8": True},
           (pre_warps, pre_stages))
    yield ("attention float32 (tests)", ta._paged_attention_kernel,
           {**{n: "*fp32" for n in ("Q", "K_CACHE", "V_CACHE", "OUT")},
            **{k: v for k, v in attn.items() if k not in ("Q", "K_CACHE", "V_CACHE", "OUT")}},
           {**base, "BLOCK_N": 64, "SPLITS": ta.SPLITS, "IEEE": True}, (4, 2))


def moe_cases():
    """The MoE targets' kernels (no PDL: PyTorch operations run before each of them), in
    the DeepSeek-V2-Lite shape: 576-wide latents (512 + 64 rope), experts of H = 2048,
    I = 1408."""
    from onespec.kernels import mla
    from onespec.kernels import moe
    from onespec.kernels import moe_route
    block_n, warps, stages = mla.TILING
    latent = {"RANK": 512, "ROPE": 64, "R_PAD": 512, "P_PAD": 64, "BLOCK_H": mla.BLOCK_H,
              "BLOCK_SIZE": 16, "BLOCK_N": block_n, "IEEE": False}
    types = {"Q": "*bf16", "CACHE": "*bf16", "OUT": "*bf16", "BLOCK_TABLES": "*i64",
             "TOKEN_REQ": "*i64", "POSITIONS": "*i64", "PART_O": "*fp32", "PART_ML": "*fp32",
             "TICKETS": "*i32", "scale": "fp32"}
    yield ("mla bf16 decode (split keys)", mla._mla_kernel, types,
           {**latent, "SPLITS": mla.SPLITS}, (warps, stages))
    yield ("mla bf16 verify / prefill (no split)", mla._mla_kernel, types,
           {**latent, "SPLITS": 1}, (warps, stages))
    yield ("mla rotary + latent write + absorbed query", mla._mla_rope_cache_kernel,
           {"Q": "*bf16", "Q_LAT": "*bf16", "CKV": "*bf16", "NORM_W": "*bf16",
            "COS_SIN": "*fp32", "POSITIONS": "*i64", "SLOTS": "*i64", "CACHE": "*bf16",
            "QUERY": "*bf16", "eps": "fp32"},
           {"NOPE": 128, "RANK": 512, "R_PAD": 512, "HALF": 32, "HALF_PAD": 32,
            "BLOCK_H": mla.BLOCK_H, "INTERLEAVE": True}, (4, 1))
    bn, bk, warps, stages = moe.TILING
    tiles = {"BLOCK_M": moe.BLOCK_M, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": False,
             "SCALED": 0, "BO": 1, "BI": 1}
    gate_up_types = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "PAIR_TOKEN": "*i32",
                     "OFFSETS": "*i32", "H_OUT": "*bf16", "S": "*bf16", "alpha": "fp32",
                     "limit": "fp32"}
    down_types = {"H": "*bf16", "W": "*bf16", "B": "*bf16", "PAIR_SLOT": "*i32",
                  "PAIR_WEIGHT": "*fp32", "OFFSETS": "*i32", "Y": "*fp32", "S": "*bf16"}
    yield ("moe gate_up + silu (grouped)", moe._gate_up_kernel, gate_up_types, tiles,
           (warps, stages))
    yield ("moe down, weighted (grouped)", moe._down_kernel, down_types, tiles,
           (warps, stages))
    yield ("moe gate_up + clamped SwiGLU with biases (gpt-oss)", moe._gate_up_kernel,
           gate_up_types, {**tiles, "HAS_BIAS": True, "CLAMPED": True}, (warps, stages))
    fp8 = {"W": "*fp8e4nv", "S": "*fp32"}
    blocked = {**tiles, "SCALED": 2, "BO": 128, "BI": 128}
    yield ("moe gate_up + silu, FP8 experts per 128 x 128 block", moe._gate_up_kernel,
           {**gate_up_types, **fp8}, blocked, (warps, stages))
    yield ("moe down, FP8 experts per 128 x 128 block", moe._down_kernel,
           {**down_types, **fp8}, blocked, (warps, stages))
    yield ("moe gate_up + silu, FP8 experts per row", moe._gate_up_kernel,
           {**gate_up_types, **fp8}, {**tiles, "SCALED": 1}, (warps, stages))
    route_types = {"LOGITS": "*fp32", "BIAS": "*fp32", "IDS": "*i32", "WEIGHTS": "*fp32",
                   "SLOTS": "*i32", "PAIR_TOKEN": "*i32", "PAIR_WEIGHT": "*fp32",
                   "OFFSETS": "*i32", "scaling": "fp32"}
    route = {"T_PAD": 32, "E": 64, "TOP_K": 6, "SIGMOID": True, "GROUPS": 1,
             "TOPK_GROUPS": 1, "NORM": True}
    yield ("moe routing + pair sort (DeepSeek-V2-Lite, batch 8 verify)",
           moe_route._route_sort_kernel, route_types, route, (4, 1))
    yield ("moe routing + pair sort (DeepSeek-V3: 256 experts, 8 groups)",
           moe_route._route_sort_kernel, route_types,
           {**route, "E": 256, "TOP_K": 8, "GROUPS": 8, "TOPK_GROUPS": 4, "T_PAD": 64},
           (4, 1))
    yield ("moe routing + pair sort (Qwen3-MoE softmax, bf16 logits)",
           moe_route._route_sort_kernel, {**route_types, "LOGITS": "*bf16"},
           {**route, "E": 128, "TOP_K": 8, "SIGMOID": False}, (4, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    p.add_argument("--linear", default="",
                   help="also the GEMV at these tilings: comma-separated "
                        "BLOCK_N:BLOCK_K:warps:stages:preload:gated")
    args = p.parse_args()
    extra = [tuple(int(v) for v in c.split(":")) for c in args.linear.split(",") if c]
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("run without TRITON_INTERPRET=1")
    ok = True
    for name, fn, types, constexprs, (warps, stages) in [*cases(args.arch, extra),
                                                         *moe_cases()]:
        row = {"kernel": name, "arch": args.arch}
        try:
            row.update(compile_one(fn, types, constexprs, args.arch, warps, stages))
            row["fits"] = row["shared_bytes"] <= SMEM_LIMIT
            ok &= row["fits"]
        except Exception as e:                  # a compile error is the finding
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            ok = False
        print(json.dumps(row), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
