"""Cross entropy over the vocabulary without materialising the softmax, and its vocab-parallel form.

The forward streams each row's logits in blocks of BLOCK_V with an online max and sum-exp, and
picks the target's logit on the way; it keeps three fp32 numbers per row. The backward streams
the logits again and writes ``(exp(x - lse) - onehot) * grad_row`` block by block.

Vocab-parallel (Megatron): each rank holds the columns [vocab_start, vocab_start + V_local) of the
logits. ``vocab_parallel_stats`` gives each row's local max, its local sum-exp (relative to that
max) and the target's logit if the target is in this slice (else 0); a ``combine`` function of
the caller's (collectives over the vocab axes) turns them into the global max, sum-exp and target
logit; ``vocab_parallel_cross_entropy`` is the per-row loss with its backward, which needs only the
global log-sum-exp and is local to each rank.
"""

from __future__ import annotations

from typing import Callable

import triton
import triton.language as tl
import torch

from ._launch import MAX, SUM, check_device, check_dtype, is_interpreting, kernel, row_warps

__all__ = ["cross_entropy", "vocab_parallel_stats", "vocab_parallel_cross_entropy", "Combine"]

# (local max, local sum-exp relative to it, local target logit) -> their global values, each (M,)
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@kernel
def _ce_stats(x_ptr, t_ptr, max_ptr, sumexp_ptr, picked_ptr, M, V, vocab_start, stride_xm,
              BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    # Program m: reads rows m*BLOCK_M.. of the logits (M, V) block by block (columns >= V and rows
    # >= M masked to -inf) and their targets; writes each row's max, sum of exp(x - max), and the
    # logit at column target - vocab_start (0 where that is outside [0, V)), all fp32.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    target = tl.load(t_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - vocab_start
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    picked = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        hit = mask & (cols[None, :] == target[:, None])  # a target past V is another rank's column
        m_new = tl.maximum(m_i, tl.reduce(x, 1, MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # masked rows: all -inf, keep NaN out
        s_i = s_i * tl.exp(m_i - m_safe) + tl.reduce(tl.exp(x - m_safe[:, None]), 1, SUM)
        m_i = m_new
        picked += tl.reduce(tl.where(hit, x, 0.0), 1, SUM)
    tl.store(max_ptr + rows, m_i, mask=row_ok)
    tl.store(sumexp_ptr + rows, s_i, mask=row_ok)
    tl.store(picked_ptr + rows, picked, mask=row_ok)


@kernel
def _ce_grad(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, M, V, vocab_start, stride_xm, stride_dxm,
             BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    # Program (m, j): reads the (BLOCK_M, BLOCK_V) tile of logits at rows m*BLOCK_M.., columns
    # j*BLOCK_V.., the rows' targets, global log-sum-exp and loss gradient; writes
    # dx = (exp(x - lse) - [column == target - vocab_start]) * grad. Stores masked to (M, V).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    target = tl.load(t_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - vocab_start
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    dx = (tl.exp(x - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * g[:, None]
    tl.store(dx_ptr + rows64[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _blocks(v: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_V, num_warps). Small tiles under the interpreter, so small test vocabularies
    span several blocks with a masked tail."""
    tile = 512 if is_interpreting() else 8192
    block_v = min(triton.next_power_of_2(v), 64 if is_interpreting() else 4096)
    block_m = max(1, min(16, tile // block_v))
    return block_m, block_v, row_warps(block_m * block_v)


def _check(op: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.ndim < 2 or logits.shape[-1] == 0:
        raise ValueError(f"{op}: logits have shape {tuple(logits.shape)}; they must be (..., vocab) with at least "
                         "one token dim and a non-empty vocab.")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: targets have shape {tuple(targets.shape)} but logits {tuple(logits.shape)}; "
                         f"targets must have the logits' shape without the vocab dim, {tuple(logits.shape[:-1])}.")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: targets have dtype {targets.dtype}; they must be int64 or int32 class ids.")
    check_dtype(op, "logits", logits)
    check_device(op, logits, targets)


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.reshape(-1, logits.shape[-1])
    return (x if x.stride(-1) == 1 else x.contiguous()), targets.reshape(-1).contiguous()


def vocab_parallel_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (..., V_local), fp32 and of shape (...): the max, the sum of
    exp(logit - max), and the logit of ``targets`` (global class ids) if in
    [vocab_start, vocab_start + V_local), else 0. No gradient."""
    _check("vocab_parallel_stats", logits, targets)
    x, t = _rows(logits, targets)
    m, v = x.shape
    out = [torch.empty(m, dtype=torch.float32, device=x.device) for _ in range(3)]
    block_m, block_v, warps = _blocks(v)
    _ce_stats[(triton.cdiv(m, block_m),)](x, t, *out, m, v, int(vocab_start), x.stride(0),
                                          BLOCK_M=block_m, BLOCK_V=block_v, num_warps=warps)
    return tuple(o.view(targets.shape) for o in out)


def _grad(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, vocab_start: int) -> torch.Tensor:
    m, v = x.shape
    dx = torch.empty_like(x)
    block_m, block_v, warps = _blocks(v)
    _ce_grad[(triton.cdiv(m, block_m), triton.cdiv(v, block_v))](
        x, t, lse, g.float().contiguous(), dx, m, v, int(vocab_start), x.stride(0), dx.stride(0),
        BLOCK_M=block_m, BLOCK_V=block_v, num_warps=warps)
    return dx


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t, vocab_start: int, combine: Combine):
        m, se, picked = vocab_parallel_stats(x, t, vocab_start)
        m, se, picked = combine(m, se, picked)
        lse = m + torch.log(se)  # (M,) fp32, global
        ctx.save_for_backward(x, t, lse)
        ctx.vocab_start = vocab_start
        return lse - picked

    @staticmethod
    def backward(ctx, g):
        x, t, lse = ctx.saved_tensors
        return _grad(x, t, lse, g, ctx.vocab_start), None, None, None


def _local(m, se, picked):
    return m, se, picked


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                                 combine: Combine = _local) -> torch.Tensor:
    """Per-row losses (...,) fp32 for this rank's logits (..., V_local), the columns from
    ``vocab_start``. ``combine(max, sumexp, picked)`` returns the global values: the max over
    ranks, the sum over ranks of ``sumexp * exp(max - global_max)``, the sum of ``picked``. It runs
    in the forward, outside autograd; the backward is local: ``(softmax - onehot) * grad`` on this
    rank's columns, with the global log-sum-exp."""
    _check("vocab_parallel_cross_entropy", logits, targets)
    x, t = _rows(logits, targets)
    return _VocabParallelCE.apply(x, t, int(vocab_start), combine).view(targets.shape)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of -log softmax(logits)[target]; logits (..., V), targets (...) class ids
    in [0, V) (not checked: that would synchronise with the GPU). The loss has the logits' dtype,
    as ``torch.nn.functional.cross_entropy``; sums are fp32."""
    _check("cross_entropy", logits, targets)
    x, t = _rows(logits, targets)
    return _VocabParallelCE.apply(x, t, 0, _local).mean().to(logits.dtype)
