"""Which implementation the torch backend's ops use: the Triton kernels or plain torch.

The choice is an explicit argument (``TorchOps(kernels=...)``); ``use_kernels`` is a context
manager over it, and ``PARLAY_KERNELS=auto|triton|torch`` sets the process default. "auto" runs
the kernels on CUDA tensors when Triton imports, plain torch otherwise. "triton" forces them:
on CPU tensors that needs ``TRITON_INTERPRET=1`` (Triton's numpy interpreter, for tests).
This module does not import triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import importlib
import os
from typing import Iterator

import torch

__all__ = ["Kernels", "use_kernels", "set_kernels", "current_kernels", "should_use_triton", "triton_error"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Kernels(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: "Kernels | str", *, source: str = "kernels") -> "Kernels":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(repr(k.value) for k in cls)
            raise ValueError(f"{source}={value!r} is not a kernel choice; use one of {choices}.") from None


_override: contextvars.ContextVar[Kernels | None] = contextvars.ContextVar("parlay_kernels", default=None)


def current_kernels() -> Kernels:
    """The innermost ``use_kernels``/``set_kernels`` choice, else ``$PARLAY_KERNELS``, else auto."""
    chosen = _override.get()
    if chosen is not None:
        return chosen
    return Kernels.parse(os.environ.get("PARLAY_KERNELS", "auto"), source="PARLAY_KERNELS")


def set_kernels(mode: Kernels | str | None) -> None:
    """Set the choice for this context (``None``: back to ``$PARLAY_KERNELS``)."""
    _override.set(None if mode is None else Kernels.parse(mode))


@contextlib.contextmanager
def use_kernels(mode: Kernels | str) -> Iterator[Kernels]:
    """``with use_kernels("triton"): ...`` runs the ops that take no explicit choice with ``mode``."""
    token = _override.set(Kernels.parse(mode))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


@functools.cache
def triton_error() -> str | None:
    """Why the kernels cannot be used (Triton missing or broken), or None. Imported on first use."""
    try:
        importlib.import_module(f"{__package__}._attention")  # imports triton and triton.language
    except Exception as e:  # a broken install fails in many ways, not only ImportError
        return f"{type(e).__name__}: {e}"
    return None


def should_use_triton(mode: Kernels | str | None, *tensors: torch.Tensor, supported: bool = True) -> bool:
    """Whether an op on ``tensors`` runs the Triton kernel. ``mode`` None means ``current_kernels()``.
    ``supported``: the op's own shape limits (auto falls back to torch outside them; a forced
    "triton" runs the kernel, which then raises its ValueError)."""
    mode = current_kernels() if mode is None else Kernels.parse(mode)
    if mode is Kernels.TORCH:
        return False
    if mode is Kernels.TRITON:
        return True
    return (supported and all(t.is_cuda and t.dtype in SUPPORTED_DTYPES for t in tensors)
            and triton_error() is None)
