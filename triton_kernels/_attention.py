"""Causal or full attention in the FlashAttention-2 manner, forward and backward.

q is (B, H, Sq, D); k and v are (B, Hkv, Sk, D) with Hkv dividing H: kv head j serves query heads
j*G .. (j+1)*G - 1, G = H / Hkv (consecutive, as ``repeat_interleave``). Causal is top-left
aligned (query i sees keys 0..i), as ``scaled_dot_product_attention(is_causal=True)``.

Scores are tiles of BLOCK_M queries by BLOCK_N keys, never a full matrix. Scores are kept in
base-2 units (scale * log2(e)) so the exponentials are ``exp2``; the forward saves the per-row
log2-sum-exp2 (fp32), from which the backward recomputes each probability tile. The backward is
three kernels: delta = rowsum(dO * O); dK, dV with one program per key block and kv head, looping
over the G query heads it serves (so GQA needs no atomics and no expanded k, v); dQ with one
program per query block. Head dims that are not a power of two are padded to one in registers
(masked loads and stores).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
import torch

from ._launch import MAX, SUM, check_device, check_dtype, dot_dtype, dot_precision, is_interpreting, kernel

__all__ = ["attention"]

_MAX_HEAD_DIM = 256


@kernel
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
              stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
              stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_os, stride_od,
              H, GROUP, SQ, SK, D, qk_scale,
              CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (m, b*H + h): reads query rows m*BLOCK_M.. of head h and, block by block, the keys
    # and values of kv head h // GROUP they may see; writes those rows of o and their log2-sum-exp2
    # (lse, (B*H, SQ) fp32). Rows >= SQ, keys >= SK and head-dim columns >= D load as 0; masked
    # keys get score -inf; stores are masked to rows < SQ and columns < D.
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < SQ, offs_d < D
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    q_base = q_ptr + b64 * stride_qb + h64 * stride_qh
    k_base = k_ptr + b64 * stride_kb + hk64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + hk64 * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)  # later key blocks are all in the future
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SK
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0).to(DOT)  # (D, N)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        valid = n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float("-inf"))
        # Key 0 is in the first block and visible to every row, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        p = p.to(v_ptr.dtype.element_ty).to(DOT)  # P @ V in the input dtype, as FlashAttention
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT), input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    o_base = o_ptr + b64 * stride_ob + h64 * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, o.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * SQ + offs_m, m_i + tl.log2(l_i), mask=m_ok)


@kernel
def _attn_bwd_delta(o_ptr, do_ptr, delta_ptr, stride_ob, stride_oh, stride_os, stride_od,
                    stride_dob, stride_doh, stride_dos, stride_dod, H, SQ, D,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (m, b*H + h): delta = rowsum(dO * O) of rows m*BLOCK_M.. into delta ((B*H, SQ), fp32).
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < SQ)[:, None] & (offs_d < D)[None, :]
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * SQ + offs_m, tl.reduce(o * do, 1, SUM), mask=offs_m < SQ)


@kernel
def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                   stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
                   stride_vb, stride_vh, stride_vs, stride_vd, stride_dob, stride_doh, stride_dos, stride_dod,
                   stride_dkb, stride_dkh, stride_dks, stride_dkd, stride_dvb, stride_dvh, stride_dvs, stride_dvd,
                   H, HKV, GROUP, SQ, SK, D, qk_scale, sm_scale,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (n, b*HKV + hk): reads keys and values n*BLOCK_N.. of kv head hk, and for each of
    # the GROUP query heads it serves every query block that may see them (q, dO, lse, delta);
    # writes dK and dV of those keys (summed over the group). Masks as in the forward; masked
    # probabilities are set to 0.
    pid_n, bhk = tl.program_id(0), tl.program_id(1)
    b, hk = bhk // HKV, bhk % HKV
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n < SK, offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b64 * stride_kb + hk64 * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0).to(DOT)
    v = tl.load(v_ptr + b64 * stride_vb + hk64 * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0).to(DOT)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys
    for g in range(0, GROUP):
        h64 = hk64 * GROUP + g
        bh64 = b64 * H + h64
        q_base = q_ptr + b64 * stride_qb + h64 * stride_qh
        do_base = do_ptr + b64 * stride_dob + h64 * stride_doh
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < SQ
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
            lse = tl.load(lse_ptr + bh64 * SQ + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + bh64 * SQ + offs_m, mask=m_ok, other=0.0)
            qk_t = tl.dot(k, tl.trans(q.to(DOT)), input_precision=PREC)  # (N, M)
            valid = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, tl.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do_ptr.dtype.element_ty).to(DOT), do.to(DOT), input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do.to(DOT)), input_precision=PREC)  # (N, M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_ptr.dtype.element_ty).to(DOT), q.to(DOT), input_precision=PREC)
    dk = dk * sm_scale
    tl.store(dk_ptr + b64 * stride_dkb + hk64 * stride_dkh + offs_n[:, None] * stride_dks
             + offs_d[None, :] * stride_dkd, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + b64 * stride_dvb + hk64 * stride_dvh + offs_n[:, None] * stride_dvs
             + offs_d[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@kernel
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                 stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
                 stride_vb, stride_vh, stride_vs, stride_vd, stride_dob, stride_doh, stride_dos, stride_dod,
                 stride_dqb, stride_dqh, stride_dqs, stride_dqd,
                 H, GROUP, SQ, SK, D, qk_scale, sm_scale,
                 CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (m, b*H + h): reads query rows m*BLOCK_M.. of head h (q, dO, lse, delta) and the
    # key and value blocks they may see; writes dQ of those rows. Masks as in the forward.
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < SQ, offs_d < D
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(DOT)
    do = tl.load(do_ptr + b64 * stride_dob + h64 * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0).to(DOT)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * SQ + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * SQ + offs_m, mask=m_ok, other=0.0)
    k_base = k_ptr + b64 * stride_kb + hk64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + hk64 * stride_vh
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SK
        kv_mask = n_ok[None, :] & d_ok[:, None]
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd, mask=kv_mask, other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None] * stride_vd, mask=kv_mask, other=0.0)
        qk = tl.dot(q, kt.to(DOT), input_precision=PREC)  # (M, N)
        valid = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.exp2(qk * qk_scale - lse[:, None]), 0.0)
        dp = tl.dot(do, vt.to(DOT), input_precision=PREC)  # (M, N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_ptr.dtype.element_ty).to(DOT), tl.trans(kt.to(DOT)), input_precision=PREC)
    dq = dq * sm_scale
    tl.store(dq_ptr + b64 * stride_dqb + h64 * stride_dqh + offs_m[:, None] * stride_dqs
             + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty), mask=q_mask)


def _config(d: int, dtype: torch.dtype) -> dict:
    """Tile sizes. Small under the interpreter, so that small test shapes span several tiles."""
    block_d = max(16, triton.next_power_of_2(d))
    if is_interpreting():
        return dict(fwd=(16, 16), bwd=(16, 16), block_d=block_d, warps=4, stages=1)
    wide = dtype == torch.float32 or block_d > 128
    return dict(fwd=(64, 32) if wide else (128, 64), bwd=(32, 32) if wide else (64, 64), block_d=block_d,
                warps=8 if block_d > 64 else 4, stages=2 if wide else 3)


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_m: int | None, block_n: int | None):
        B, H, SQ, D = q.shape
        HKV, SK = k.shape[1], k.shape[2]
        cfg = _config(D, q.dtype)
        bm, bn = block_m or cfg["fwd"][0], block_n or cfg["fwd"][1]
        o = torch.empty_like(q)
        lse = torch.empty((B * H, SQ), dtype=torch.float32, device=q.device)
        sm_scale = 1.0 / math.sqrt(D)
        _attn_fwd[(triton.cdiv(SQ, bm), B * H)](
            q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            H, H // HKV, SQ, SK, D, sm_scale * math.log2(math.e),
            CAUSAL=causal, DOT=dot_dtype(q.dtype), PREC=dot_precision(q.dtype),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=cfg["block_d"], num_warps=cfg["warps"], num_stages=cfg["stages"])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.blocks = causal, (block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, SQ, D = q.shape
        HKV, SK = k.shape[1], k.shape[2]
        cfg = _config(D, q.dtype)
        bm, bn = ctx.blocks[0] or cfg["bwd"][0], ctx.blocks[1] or cfg["bwd"][1]
        sm_scale = 1.0 / math.sqrt(D)
        qk_scale = sm_scale * math.log2(math.e)
        delta = torch.empty_like(lse)
        _attn_bwd_delta[(triton.cdiv(SQ, bm), B * H)](
            o, do, delta, *_strides(o), *_strides(do), H, SQ, D, BLOCK_M=bm, BLOCK_D=cfg["block_d"])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        meta = dict(CAUSAL=ctx.causal, DOT=dot_dtype(q.dtype), PREC=dot_precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_D=cfg["block_d"], num_warps=cfg["warps"], num_stages=cfg["stages"])
        _attn_bwd_dkdv[(triton.cdiv(SK, bn), B * HKV)](
            q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            *_strides(dk), *_strides(dv), H, HKV, H // HKV, SQ, SK, D, qk_scale, sm_scale, **meta)
        _attn_bwd_dq[(triton.cdiv(SQ, bm), B * H)](
            q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
            H, H // HKV, SQ, SK, D, qk_scale, sm_scale, **meta)
        return dq, dk, dv, None, None, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention: got {shapes}; q, k and v must be 4-d: (batch, heads, seq, head_dim).")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention: got {shapes}; k and v must have one shape, with q's batch and head_dim.")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: got {shapes}; k and v's {k.shape[1]} heads must divide q's {q.shape[1]} "
                         "(grouped-query attention: kv head j serves query heads j*G..(j+1)*G-1).")
    if min(q.shape) == 0 or k.shape[2] == 0:
        raise ValueError(f"attention: got {shapes}; every dim must be non-empty.")
    if q.shape[3] > _MAX_HEAD_DIM:
        raise ValueError(f"attention: head_dim {q.shape[3]} ({shapes}) is over the {_MAX_HEAD_DIM} the kernels "
                         "tile; use the torch ops for it.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype("attention", name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; they must be one dtype.")
    check_device("attention", q, k, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, *,
              block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), causal mask) v per head, for q (B, H, Sq, D) and k, v
    (B, Hkv, Sk, D) with Hkv dividing H. Returns (B, H, Sq, D) in q's dtype.
    ``block_m``/``block_n`` override the tile sizes (powers of two, at least 16)."""
    _check(q, k, v)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk is not None and (blk < 16 or blk & (blk - 1)):
            raise ValueError(f"attention: {name}={blk}; a tile size must be a power of two, at least 16 (tl.dot's "
                             "smallest tile).")
    return _Attention.apply(q, k, v, bool(causal), block_m, block_n)
