"""One AdamW step over many tensors in one launch per dtype combination, as torch.optim.AdamW.

The tensors are cut into chunks of CHUNK elements; a table on the device lists, per chunk, the
addresses of its parameter, gradient and two moment tensors, its first element and the tensor's
size. Program c reads row c, turns the addresses into typed pointers (as Triton's grouped GEMM
tutorial does) and updates its chunk in place. Arithmetic is fp32; each tensor keeps its dtype.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import triton.language as tl
import torch
from torch.autograd.graph import increment_version

from ._launch import FLOAT_DTYPES, TL_DTYPES, check_device, is_interpreting, kernel

__all__ = ["adamw_step"]


@kernel
def _adamw(table_ptr, decay, lerp_w, beta2, one_minus_beta2, eps, step_size, bc2_sqrt,
           P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
           CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Program c: row c of the table (param, grad, exp_avg, exp_avg_sq addresses, start, numel).
    # Reads and writes elements [start, start + CHUNK) of those tensors, masked to < numel; the
    # gradient is only read.
    row = table_ptr + tl.program_id(0) * 6
    p_ptr = tl.load(row).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DT))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(M_DT))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(V_DT))
    start = tl.load(row + 4)
    numel = tl.load(row + 5)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < numel
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = p * decay  # decoupled weight decay: p *= 1 - lr * weight_decay
        # exp_avg.lerp_(grad, 1 - beta1), with torch's two forms of lerp
        m = tl.where(lerp_w < 0.5, m + lerp_w * (g - m), g - (g - m) * (1.0 - lerp_w))
        v = v * beta2 + one_minus_beta2 * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + idx, p.to(P_DT), mask=mask)
        tl.store(m_ptr + idx, m.to(M_DT), mask=mask)
        tl.store(v_ptr + idx, v.to(V_DT), mask=mask)


_TABLES: OrderedDict = OrderedDict()  # (device, chunk, addresses and sizes) -> the table on the device


def _table(group: list[tuple[torch.Tensor, ...]], chunk: int) -> torch.Tensor:
    device = group[0][0].device
    key = (str(device), chunk) + tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
                                       for p, g, m, v in group)
    table = _TABLES.get(key)
    if table is None:
        rows = [(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), start, p.numel())
                for p, g, m, v in group for start in range(0, p.numel(), chunk)]
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        _TABLES[key] = table
        if len(_TABLES) > 16:
            _TABLES.popitem(last=False)
    return table


def _check(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay) -> None:
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    sizes = {k: len(v) for k, v in lists.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"adamw_step: the lists have lengths {sizes}; they must have one tensor each per parameter.")
    for i, ts in enumerate(zip(*lists.values())):
        shapes = [tuple(t.shape) for t in ts]
        if len(set(shapes)) != 1:
            raise ValueError(f"adamw_step: parameter {i}: shapes {dict(zip(lists, shapes))} differ; a parameter's "
                             "grad and moments must have its shape.")
        for name, t in zip(lists, ts):
            if t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"adamw_step: {name}[{i}] has dtype {t.dtype}; the kernel takes float32, "
                                 "bfloat16 or float16.")
            if not t.is_contiguous():
                raise ValueError(f"adamw_step: {name}[{i}] (shape {tuple(t.shape)}) is not contiguous; the kernel "
                                 "updates tensors as flat memory.")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"adamw_step: step={step!r}; it must be the 1-based count of this update (an int >= 1), as "
                         "torch.optim.AdamW's state['step'] after its increment.")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"adamw_step: betas ({beta1}, {beta2}); each must be in [0, 1).")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"adamw_step: lr={lr}, eps={eps}, weight_decay={weight_decay}; none may be negative.")
    if params:
        check_device("adamw_step", *(t for ts in lists.values() for t in ts))


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float) -> None:
    """In place, for every i: params[i], exp_avgs[i], exp_avg_sqs[i] take one AdamW step with
    grads[i], as ``torch.optim.AdamW`` (no amsgrad, not maximize): p *= 1 - lr*wd;
    m = lerp(m, g, 1 - beta1); v = beta2*v + (1 - beta2)*g^2;
    p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)."""
    params, grads, exp_avgs, exp_avg_sqs = map(list, (params, grads, exp_avgs, exp_avg_sqs))
    _check(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay)
    groups: dict = {}
    for ts in zip(params, grads, exp_avgs, exp_avg_sqs):
        if ts[0].numel():
            groups.setdefault(tuple(t.dtype for t in ts), []).append(ts)
    block = 64 if is_interpreting() else 1024
    chunk = 4 * block if is_interpreting() else 64 * block
    scalars = (1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps, lr / (1.0 - beta1 ** step),
               math.sqrt(1.0 - beta2 ** step))
    for dtypes, group in groups.items():
        table = _table(group, chunk)
        _adamw[(table.shape[0],)](table, *scalars, *(TL_DTYPES[d] for d in dtypes), CHUNK=chunk, BLOCK=block,
                                  num_warps=4)
    increment_version(params + exp_avgs + exp_avg_sqs)  # written through raw pointers: tell autograd
