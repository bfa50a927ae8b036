"""The recurrences of linear-attention layers, in portable PyTorch (any device, float32
state), written so that a verify of K+1 rows can keep the state after every row.

    causal_conv(x, state, weight)      depthwise causal conv1d over time with its last
                                       W - 1 inputs as state, then SiLU
    gated_delta_scan(q, k, v, g, beta) the gated delta rule (Qwen3-Next / Qwen3.5):
        S <- S * exp(g_t)
        S <- S + k_t (x) beta_t (v_t - S^T k_t)       (S [Dk, Dv] per value head)
        o_t = S^T q_t
      with q, k L2-normalised per head and q scaled by Dk^-1/2.
    mamba2_scan(x, dt, A, B, C, D)     the Mamba2 selective scan (Nemotron-H):
        S <- S * exp(dt_t A) + dt_t x_t (x) B_t        (S [P, N] per head)
        y_t = S C_t + D x_t
      B and C shared by the heads of a group.

Both take a batch of B sequences of L rows with their initial states and return the
outputs with either the final state or the state after each row ([B, L, ...]: the
per-position snapshots a speculative verify commits from, engine/state_pool.py).
`gated_delta_chunked` and `mamba2_chunked` compute the final-state forms block by block
(matmuls and one triangular solve per block instead of a step per row): prompt chunks.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                keep_all: bool = False, bias: torch.Tensor | None = None):
    """x [B, L, C], state [B, C, W-1] (the inputs before x), weight [C, W], bias [C] ->
    (silu(conv) [B, L, C], the state after the last row [B, C, W-1], or after each row
    [B, L, C, W-1] with keep_all)."""
    length, width = x.shape[1], weight.shape[1]
    seq = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)       # [B, C, W-1+L]
    y = F.conv1d(seq.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    y = F.silu(y).to(x.dtype).transpose(1, 2)                              # [B, L, C]
    if keep_all:       # after row j the state is inputs j+1 .. j+W-1 of seq
        states = seq.unfold(-1, width - 1, 1)[:, :, 1:]                    # [B, C, L, W-1]
        return y, states.permute(0, 2, 1, 3)
    return y, seq[:, :, length:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_scan(q, k, v, g, beta, state: torch.Tensor, keep_all: bool = False):
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g (log decay), beta [B, L, Hv], state
    [B, Hv, Dk, Dv] float32 -> (o [B, L, Hv, Dv] in v's dtype, the final state, or the
    state after each row [B, L, Hv, Dk, Dv] with keep_all)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
        if keep_all:
            states.append(s)
    o = torch.stack(outs, 1)
    return o, torch.stack(states, 1) if keep_all else s


def mamba2_scan(x, dt, A, B, C, D, state: torch.Tensor, keep_all: bool = False):
    """x [B, L, H, P], dt [B, L, H] (after softplus and limits), A [H] (negative), B, C
    [B, L, G, N], D [H], state [B, H, P, N] float32 -> (y [B, L, H, P] float32, the final
    state, or the state after each row [B, L, H, P, N] with keep_all)."""
    rep = x.shape[2] // B.shape[2]
    B = B.float().repeat_interleave(rep, dim=2)
    C = C.float().repeat_interleave(rep, dim=2)
    x, dt = x.float(), dt.float()
    s = state.float()
    outs, states = [], []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A.float())                            # [B, H]
        s = s * decay[..., None, None] + \
            (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outs.append(torch.einsum("bhpn,bhn->bhp", s, C[:, t]) + D.float()[:, None] * x[:, t])
        if keep_all:
            states.append(s)
    y = torch.stack(outs, 1)
    return y, torch.stack(states, 1) if keep_all else s


# ---- chunked (block-parallel) forms for prompt chunks -------------------------------------
#
# Within a block of n rows, with G_t the cumulative log decay from the block's start
# (G_t = g_1 + ... + g_t, resp. dt_1 A + ... + dt_t A) and S_0 the state entering it, every
# state is S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} (row i's update), so a block costs
# a few [n, n] and [n, D] matmuls instead of n dependent steps. Blocks run in order,
# carrying the state. Same formulas as the token loops, so they agree to float32 rounding.


def _decay_matrix(cum: torch.Tensor) -> torch.Tensor:
    """cum [..., n] cumulative log decay -> [..., n, n] with e^{G_t - G_i} for i <= t, 0
    above the diagonal (masked before the exp, which would overflow there)."""
    n = cum.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril()
    diff = cum[..., :, None] - cum[..., None, :]
    return torch.where(lower, diff, float("-inf")).exp()


def gated_delta_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """gated_delta_scan's final-state form, block by block (the WY / UT form): in a block,
    the rows' corrections u_t = beta_t (v_t - e^{G_t} S_0^T k_t - sum_{i<t} e^{G_t - G_i}
    (k_t . k_i) u_i) are one unit lower-triangular solve, then
        o_t = e^{G_t} S_0^T q_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) u_i
        S_n = e^{G_n} S_0 + sum_i e^{G_n - G_i} k_i u_i^T.
    Shapes as gated_delta_scan's -> (o [B, L, Hv, Dv] float32, state [B, Hv, Dk, Dv])."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q = (l2norm(q.float()) * q.shape[-1] ** -0.5).transpose(1, 2)        # [B, H, L, Dk]
    k = l2norm(k.float()).transpose(1, 2)
    v = v.float().transpose(1, 2)                                          # [B, H, L, Dv]
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)      # [B, H, L]
    s = state.float()
    outs = []
    for c in range(0, q.shape[2], chunk):
        qc, kc, vc = q[:, :, c:c + chunk], k[:, :, c:c + chunk], v[:, :, c:c + chunk]
        bc, cum = beta[..., c:c + chunk], g[..., c:c + chunk].cumsum(-1)
        decay = _decay_matrix(cum)                                         # [B, H, n, n]
        gamma = cum.exp()[..., None]                                       # [B, H, n, 1]
        a = (decay * (kc @ kc.transpose(-1, -2))).tril(-1) * bc[..., None]
        rhs = bc[..., None] * (vc - gamma * (kc @ s))
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append(gamma * (qc @ s) + (decay * (qc @ kc.transpose(-1, -2))) @ u)
        tail = (cum[..., -1:] - cum).exp()[..., None]                      # e^{G_n - G_i}
        s = gamma[..., -1:, :] * s + (kc * tail).transpose(-1, -2) @ u
    return torch.cat(outs, 2).transpose(1, 2), s


def mamba2_chunked(x, dt, A, B, C, D, state: torch.Tensor, chunk: int = 64):
    """mamba2_scan's final-state form, block by block (the SSD chunked scan):
        y_t = e^{G_t} S_0 C_t + sum_{i<=t} e^{G_t - G_i} dt_i (C_t . B_i) x_i + D x_t
        S_n = e^{G_n} S_0 + sum_i e^{G_n - G_i} dt_i x_i B_i^T.
    Shapes as mamba2_scan's -> (y [B, L, H, P] float32, state [B, H, P, N])."""
    rep = x.shape[2] // B.shape[2]
    B = B.float().repeat_interleave(rep, dim=2).transpose(1, 2)            # [B, H, L, N]
    C = C.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    x = x.float().transpose(1, 2)                                          # [B, H, L, P]
    dt = dt.float().transpose(1, 2)                                        # [B, H, L]
    log_a = dt * A.float()[:, None]
    s = state.float()                                                      # [B, H, P, N]
    outs = []
    for c in range(0, x.shape[2], chunk):
        xc, bc, cc, dtc = x[:, :, c:c + chunk], B[:, :, c:c + chunk], C[:, :, c:c + chunk], \
            dt[..., c:c + chunk]
        cum = log_a[..., c:c + chunk].cumsum(-1)
        gamma = cum.exp()[..., None]                                       # [B, H, n, 1]
        w = _decay_matrix(cum) * (cc @ bc.transpose(-1, -2)) * dtc[..., None, :]
        outs.append(gamma * (cc @ s.transpose(-1, -2)) + w @ xc)
        tail = ((cum[..., -1:] - cum).exp() * dtc)[..., None]              # [B, H, n, 1]
        s = gamma[..., -1:, :] * s + (xc * tail).transpose(-1, -2) @ bc
    y = torch.cat(outs, 2).transpose(1, 2)
    return y + D.float()[:, None] * x.transpose(1, 2), s


class RecurrentMixer(nn.Module):
    """The plumbing that the recurrent layers (models/qwen3_next.py GatedDeltaNet,
    models/nemotron_h.py Mamba2Mixer) share: per segment of meta.recurrent, the causal
    conv from the slot's state, then the recurrence in the form the rows want (a prompt
    chunk block-parallel, verify rows through kernels/recurrent.py's Triton launch on CUDA,
    else the portable scan), and the snapshots it leaves. Subclasses hold conv1d, `states`
    and `snapshots` (engine/state_pool.py allocates them)."""

    # the recurrence through kernels/recurrent.py's Triton launches (verify rows, and
    # prompt chunks when prefill_chunk is 0): None = on CUDA (tests set True to run
    # them in Triton's interpreter)
    verify_kernel: bool | None = None
    # prompt chunks run the block-parallel form (gated_delta_chunked / mamba2_chunked)
    # in blocks of this many rows, on every device; 0 = row by row, as verify rows
    prefill_chunk: int = 64

    def recur(self, rb, conv_in: torch.Tensor, conv_bias, args_of, chunked, scan,
              verify_name: str):
        """Yields (rows, out) per segment of rb (a RecurrentBatch): conv_in [T, C] through
        the causal conv, args_of(mixed [n, L, C], rows, n, L) the recurrence's inputs,
        then chunked / the kernel `verify_name` / scan on them; the snapshots are saved
        after each yield."""
        weight = self.conv1d.weight.squeeze(1)                               # [C, W]
        use_kernel = conv_in.is_cuda if self.verify_kernel is None else self.verify_kernel
        for rows, reqs, snap, keep_all in rb.segments():
            init = rb.initial(self.states, reqs)
            n, length = len(reqs), (rows.stop - rows.start) // len(reqs)
            mixed, conv_s = causal_conv(conv_in[rows].view(n, length, -1), init["conv"],
                                        weight, keep_all, conv_bias)
            args = args_of(mixed, rows, n, length)
            if not keep_all and self.prefill_chunk:
                out, ssm_s = chunked(*args, init["ssm"], self.prefill_chunk)
            elif use_kernel:
                verify = getattr(importlib.import_module("onespec.kernels.recurrent"),
                                 verify_name)
                idx = rb.select(reqs)
                out, ssm_s = verify(*args, self.states["ssm"], rb.slots[idx], rb.fresh[idx],
                                    keep_all)
            else:
                out, ssm_s = scan(*args, init["ssm"], keep_all)
            yield rows, out
            rb.save(self.snapshots, snap, {"conv": conv_s, "ssm": ssm_s})
