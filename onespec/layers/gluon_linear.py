"""A decode GEMV for the projection after attention, in Gluon (Triton's explicit dialect).

At batch 1 the attention of a layer reads a few hundred KB of keys and takes ~7 us in
which the memory streams nothing; the projection after it (o_proj) then streams its 32 MB
(8B shape). Here the projection's programs, launched while attention runs (programmatic
dependent launch), fill a ring of STAGES weight tiles in shared memory with cp.async
*before* waiting for attention: Triton's pipeliner cannot issue loads ahead of
`gdc_wait`, and a register preload holds one tile. After the wait the ring is drained and
refilled as an ordinary software pipeline; x tiles come from L2 straight into registers,
one tile ahead, so the shared memory is all weights.

Rows are padded to one 16-row tensor-core tile whatever M is, so every row sees the same
instructions (results never depend on the batch). The epilogue is small_linear's: the
projection rounded to the stream's dtype, the residual added, and optionally the next
RMSNorm's share (rows * norm weight, per-program sums of squares; see Prenormed).
Only compiled Triton on Hopper or newer with 16-bit weights; triton_linear.small_linear
dispatches here when asked (`ring=True`) and falls back to its own kernel otherwise.
"""
from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:      # an older Triton: small_linear keeps its own kernel
    gluon = None

STAGES = 11          # 11 x 16 KB of weights per program; attention's 39 KB fits beside it
BLOCK_N, BLOCK_K, WARPS = 32, 256, 4


def available() -> bool:
    return gluon is not None and STAGES > 0


if gluon is not None:
    @gluon.jit
    def _gdc(INSTR: gl.constexpr):
        gl.inline_asm_elementwise(INSTR + "; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _ring_linear_kernel(X, W, RES, Y, NW_OUT, XN_OUT, SS_OUT, M, N, K,
                            stride_xm, stride_wn, stride_rm, stride_ym, stride_xn_out,
                            stride_ss_out, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            STAGES: gl.constexpr, NORM_OUT: gl.constexpr,
                            PDL: gl.constexpr):
        pid = gl.program_id(0)
        w_load: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                      instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        ring = gl.allocate_shared_memory(W.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], smem)
        rn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_load))
        rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, w_load))
        w_ptrs = W + rn[:, None].to(gl.int64) * stride_wn + rk[None, :]
        n_ok = rn < N
        num_k = gl.cdiv(K, BLOCK_K)
        # weight tile j is cp.async group j; the first STAGES go out before the wait
        for s in gl.static_range(STAGES):
            async_copy.async_copy_global_to_shared(
                ring.index(s), w_ptrs + s * BLOCK_K,
                mask=n_ok[:, None] & (s * BLOCK_K + rk < K)[None, :])
            async_copy.commit_group()
        if PDL:
            _gdc("griddepcontrol.wait")
        xm = gl.arange(0, 16, layout=gl.SliceLayout(1, a_op))
        xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_op))
        x_ptrs = X + xm[:, None] * stride_xm + xk[None, :]
        x_rows = (xm < M)[:, None]
        x = gl.load(x_ptrs, mask=x_rows & (xk < K)[None, :], other=0.0)
        x1 = gl.load(x_ptrs + BLOCK_K, mask=x_rows & (BLOCK_K + xk < K)[None, :], other=0.0)
        acc = gl.zeros([16, BLOCK_N], gl.float32, mma)
        for i in range(num_k):
            # x tiles (L2) two ahead are in flight while this one is multiplied
            k2 = (i + 2) * BLOCK_K
            x2 = gl.load(x_ptrs + k2, mask=x_rows & (k2 + xk < K)[None, :], other=0.0)
            # groups committed before this point: STAGES, plus one per iteration >= 1;
            # tile i's group is then at most STAGES - 1 (i == 0) or STAGES - 2 back
            if i == 0:
                async_copy.wait_group(STAGES - 1)
            else:
                async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()     # tile i visible to all; slot (i - 1) % STAGES read by all
            if i > 0:               # refill the slot tile i - 1 held (past K: zeros, unused)
                refill = i - 1 + STAGES
                async_copy.async_copy_global_to_shared(
                    ring.index((i + STAGES - 1) % STAGES), w_ptrs + refill * BLOCK_K,
                    mask=n_ok[:, None] & (refill * BLOCK_K + rk < K)[None, :])
            async_copy.commit_group()
            w = ring.index(i % STAGES).permute([1, 0]).load(b_op)      # [BLOCK_K, BLOCK_N]
            acc = mma_v2(x, w, acc)
            x = x1
            x1 = x2
        async_copy.wait_group(0)
        if PDL:     # the weights are streamed: the next kernel may take the SMs
            _gdc("griddepcontrol.launch_dependents")
        ym = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        yn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        m_ok = ym < M
        y_ok = yn < N
        out_ok = m_ok[:, None] & y_ok[None, :]
        r = gl.load(RES + ym[:, None] * stride_rm + yn[None, :], mask=out_ok, other=0.0)
        # the projection is rounded to the stream's dtype before the add, as in PyTorch
        y = acc.to(RES.dtype.element_ty).to(gl.float32) + r.to(gl.float32)
        y = y.to(Y.dtype.element_ty)
        gl.store(Y + ym[:, None] * stride_ym + yn[None, :], y, mask=out_ok)
        if NORM_OUT:
            yf = gl.where(out_ok, y.to(gl.float32), 0.0)
            nw = gl.load(NW_OUT + yn, mask=y_ok, other=0.0).to(gl.float32)
            gl.store(XN_OUT + ym[:, None] * stride_xn_out + yn[None, :],
                     (yf * nw[None, :]).to(XN_OUT.dtype.element_ty), mask=out_ok)
            gl.store(SS_OUT + ym * stride_ss_out + pid, gl.sum(yf * yf, axis=1), mask=m_ok)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ring_linear runs this projection (16-bit weights of x's dtype, <= 16 rows)."""
    return available() and weight.dtype in (torch.bfloat16, torch.float16) and \
        x.dtype == weight.dtype and x.shape[0] <= 16 and weight.stride(1) == 1 and \
        weight.shape[1] % 16 == 0 and weight.stride(0) % 16 == 0   # 16-byte cp.async pieces


def grid(n: int) -> int:
    return -(-n // BLOCK_N)


def ring_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                out: torch.Tensor, pdl: bool, norm_out=None) -> None:
    """out = residual + x @ weight.T (rounded first); norm_out = (norm weight, xn [M, N],
    ss [M, grid(N)]) also receives the next RMSNorm's share. Inputs checked by the caller."""
    m, k = x.shape
    n = weight.shape[0]
    nw, xn, ss = norm_out if norm_out is not None else (out, out, out)
    _ring_linear_kernel[(grid(n),)](
        x, weight, residual, out, nw, xn, ss, m, n, k, x.stride(0), weight.stride(0),
        residual.stride(0), out.stride(0), xn.stride(0) if norm_out is not None else 0,
        ss.stride(0) if norm_out is not None else 0,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=STAGES, NORM_OUT=norm_out is not None,
        PDL=pdl, num_warps=WARPS, **({"launch_pdl": True} if pdl else {}))
