"""Fused RMSNorm and LayerNorm over the last dim, forward and backward.

The forward keeps each row in registers (a row of up to 64 KiB) and saves per-row fp32 statistics
(mean for LayerNorm, 1/std). The backward recomputes the normalized rows from them; each program
walks a strided set of row blocks and writes one partial sum of the weight (and bias) gradient,
and the partials (programs x N, fp32) are summed afterwards: no atomics, a fixed reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from ._launch import SUM, check_device, check_dtype, is_interpreting, kernel, max_programs, row_warps

__all__ = ["rms_norm", "layer_norm"]

_MAX_ROW_BYTES = 65536


@kernel
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, eps, stride_xm, stride_ym,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Reads BLOCK_M rows of x (rows >= M and columns >= N masked, read as 0); writes those rows of
    # y and each row's mean (LayerNorm only) and 1/std, in fp32.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.reduce(x, 1, SUM) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)  # masked columns must not count in the variance
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    rstd = 1.0 / tl.sqrt(tl.reduce(xc * xc, 1, SUM) / N + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def _norm_bwd(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, M, N,
              stride_xm, stride_dym, stride_dxm,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program p handles row blocks p, p + P, p + 2P, ... (P programs). Reads x, dy and the saved
    # statistics of those rows (masked as in the forward), writes their dx, and writes its partial
    # sums of dw (and db) over them to row p of dw_ptr (and db_ptr), P x N fp32.
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    db = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, nprog * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.reduce(xhat * wdy, 1, SUM) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.reduce(wdy, 1, SUM) / N
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.reduce(dy * xhat, 0, SUM)
        if HAS_BIAS:
            db += tl.reduce(dy, 0, SUM)
    tl.store(dw_ptr + pid * N + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(db_ptr + pid * N + cols, db, mask=col_ok)


def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a whole row per tile, several short rows per tile."""
    block_n = triton.next_power_of_2(n)
    tile = 1024 if is_interpreting() else 4096
    block_m = max(1, min(16, tile // block_n))
    return block_m, block_n, row_warps(block_m * block_n)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, is_rms: bool):
        n = x.shape[-1]
        x2 = _rows(x, n)
        m = x2.shape[0]
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        if bias is not None:
            out_dtype = torch.promote_types(out_dtype, bias.dtype)
        y = torch.empty((m, n), dtype=out_dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        mean = rstd if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
        block_m, block_n, warps = _blocks(n)
        _norm_fwd[(triton.cdiv(m, block_m),)](
            x2, weight, weight if bias is None else bias, y, mean, rstd, m, n, eps, x2.stride(0), y.stride(0),
            IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.is_rms, ctx.has_bias, ctx.shape, ctx.x_dtype = is_rms, bias is not None, x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = _rows(dy, n)
        dx = torch.empty((m, n), dtype=ctx.x_dtype, device=x2.device)
        block_m, block_n, warps = _blocks(n)
        programs = max(1, min(triton.cdiv(m, block_m), max_programs(x2.device)))
        dw = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        db = torch.empty((programs, n), dtype=torch.float32, device=x2.device) if ctx.has_bias else dw
        _norm_bwd[(programs,)](
            x2, weight, dy2, dx, mean, rstd, dw, db, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        dbias = db.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), dbias, None, None


def _check(op: str, x: torch.Tensor, params: dict[str, torch.Tensor | None]) -> None:
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}; it needs a non-empty last dim to normalize over.")
    n = x.shape[-1]
    check_dtype(op, "x", x)
    for name, p in params.items():
        if p is None:
            continue
        check_dtype(op, name, p)
        if tuple(p.shape) != (n,):
            raise ValueError(f"{op}: {name} has shape {tuple(p.shape)} but x has shape {tuple(x.shape)}; "
                             f"{name} must have shape ({n},), the size of x's last dim.")
    if n * x.element_size() > _MAX_ROW_BYTES:
        raise ValueError(f"{op}: x's last dim is {n} ({x.dtype}), over the {_MAX_ROW_BYTES} bytes a row may "
                         "take in one tile; use the torch ops for this size.")
    check_device(op, x, *(p for p in params.values() if p is not None))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, statistics in fp32. x (..., N), weight (N,)."""
    _check("rms_norm", x, {"weight": weight})
    return _Norm.apply(x, weight, None, float(eps), True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last dim (biased variance, as
    ``torch.nn.functional.layer_norm``), statistics in fp32. x (..., N), weight and bias (N,)."""
    _check("layer_norm", x, {"weight": weight, "bias": bias})
    return _Norm.apply(x, weight, bias, float(eps), False)
