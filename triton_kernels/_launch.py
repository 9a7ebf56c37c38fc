"""Launching kernels compiled on CUDA or run by Triton's interpreter, chosen per launch.

``triton.jit`` decides between the compiler and the interpreter when it decorates, from
``TRITON_INTERPRET``. Decorating at import would fix that choice for the whole process, so a test
that sets the variable would change every later user. ``kernel`` keeps the plain function and
decorates it at launch, once per mode. Kernels therefore call no other ``@triton.jit``
function (a helper cannot be both kinds at once); shared code is inlined.

triton.language's own ``sum``, ``max`` and ``zeros`` are ``@triton.jit`` functions too, made
compiled or interpreted once, when triton.language is imported; a kernel run in the other mode
cannot call them. So the kernels build zeros with ``tl.full`` and reduce with
``tl.reduce(x, axis, SUM)`` / ``MAX``, names that each mode's copy of a kernel binds for itself:
the interpreter gets triton.language's combine functions (it recognises them and reduces in numpy),
the compiler gets combine functions compiled here, whatever TRITON_INTERPRET was at import.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import triton
import triton.language as tl
from triton import knobs

from ._switch import SUPPORTED_DTYPES

__all__ = ["kernel", "is_interpreting", "check_device", "check_dtype", "dot_dtype", "dot_precision", "max_programs",
           "row_warps", "SUM", "MAX"]

# In kernels, tl.reduce(x, axis, SUM) is tl.sum(x, axis) and MAX tl.max for fp32 x. These module
# values name them for readers and linters; each mode's copy of a kernel rebinds them (_combines).
SUM = tl.standard._sum_combine
MAX = tl.standard._elementwise_max

FLOAT_DTYPES = SUPPORTED_DTYPES  # what the kernels take
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def is_interpreting() -> bool:
    return bool(knobs.runtime.interpret)


def _add(a, b):
    return a + b


def _maximum(a, b):
    return tl.maximum(a, b)


@functools.cache
def _combines(interpret: bool) -> dict:
    if interpret:
        return {"SUM": tl.standard._sum_combine, "MAX": tl.standard._elementwise_max}
    return {"SUM": triton.jit(_add), "MAX": triton.jit(_maximum)}


def _bind(fn: Callable, names: dict) -> Callable:
    """``fn`` with ``names`` in its globals (same code, so triton reads the same source)."""
    bound = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
    return functools.update_wrapper(bound, fn)


class _Kernel:
    def __init__(self, fn: Callable):
        self.fn = fn
        self._by_mode: dict[bool, object] = {}
        functools.update_wrapper(self, fn)

    def jitted(self):
        """The kernel as ``triton.jit`` makes it for the current mode: compiled or interpreted."""
        mode = is_interpreting()
        jitted = self._by_mode.get(mode)
        if jitted is None:  # triton.jit reads TRITON_INTERPRET now, as _combines did
            jitted = self._by_mode[mode] = triton.jit(_bind(self.fn, _combines(mode)))
        return jitted

    def __getitem__(self, grid):
        return self.jitted()[grid]


def kernel(fn: Callable) -> _Kernel:
    return _Kernel(fn)


def check_device(op: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors on different devices {sorted(map(str, devices))}; put them on one.")
    device = devices.pop()
    if device.type != "cuda" and not is_interpreting():
        raise ValueError(f"{op}: the Triton kernels run on CUDA tensors; got {device}. On the CPU set "
                         "TRITON_INTERPRET=1 (Triton's interpreter, slow: for tests), or use the torch ops "
                         "(use_kernels('torch') or PARLAY_KERNELS=torch).")


def check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; the kernels take float32, bfloat16 or float16.")


def dot_dtype(dtype: torch.dtype):
    """The dtype ``tl.dot`` multiplies in. The interpreter's dot multiplies bfloat16's raw uint16
    storage (numpy has no bfloat16), so there bf16 tiles go to fp32 first: exact, since every bf16
    is an fp32, and the sums are fp32 either way."""
    if dtype == torch.bfloat16 and is_interpreting():
        return tl.float32
    return TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 x fp32 on tensor cores defaults to tf32 (10-bit mantissa); torch's fp32 matmul does not.
    return "ieee" if dtype == torch.float32 else "tf32"


def row_warps(elements: int) -> int:
    """Warps for a tile of ``elements`` values reduced along rows: about 8 to 32 values a thread
    (the rule of the Triton layer norm tutorial, extended as Liger's ``calculate_settings``)."""
    for limit, warps in ((32768, 32), (8192, 16), (2048, 8)):
        if elements >= limit:
            return warps
    return 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_programs(device: torch.device) -> int:
    """How many programs a reduction over rows uses (each writes one partial sum)."""
    if device.type == "cuda" and not is_interpreting():
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter runs programs one after another: few, each looping over rows
