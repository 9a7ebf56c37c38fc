"""Triton kernels for the PyTorch backend, each an autograd function (forward and backward).

``rms_norm``, ``layer_norm``, ``attention`` (FlashAttention-2, causal, grouped-query heads),
``cross_entropy`` (and its vocab-parallel pieces), ``adamw_step`` (in place, many tensors). The
torch backend's ops use them for CUDA tensors; ``use_kernels``/``PARLAY_KERNELS`` force either
side (see ``_switch``). On the CPU they run in Triton's interpreter under ``TRITON_INTERPRET=1``.

Importing this package never fails where Triton is missing or broken: the switch still works
("auto" then picks torch) and the kernel functions raise an ImportError saying why.
"""

from __future__ import annotations

from ._switch import Kernels, current_kernels, set_kernels, should_use_triton, triton_error, use_kernels

__all__ = ["rms_norm", "layer_norm", "attention", "cross_entropy", "vocab_parallel_stats",
           "vocab_parallel_cross_entropy", "adamw_step", "Kernels", "use_kernels", "set_kernels",
           "current_kernels", "should_use_triton", "triton_error"]

try:
    from ._adamw import adamw_step
    from ._attention import attention
    from ._cross_entropy import cross_entropy, vocab_parallel_cross_entropy, vocab_parallel_stats
    from ._norms import layer_norm, rms_norm
except Exception as _error:  # noqa: BLE001 (a broken Triton install fails in many ways)
    _reason = f"{type(_error).__name__}: {_error}"

    def _missing(name: str):
        def fn(*args, **kwargs):
            raise ImportError(f"parlay.triton_kernels.{name} needs a working Triton ({_reason}); "
                              "use the torch ops instead (use_kernels('torch') or PARLAY_KERNELS=torch).")
        fn.__name__ = name
        return fn

    rms_norm, layer_norm, attention = _missing("rms_norm"), _missing("layer_norm"), _missing("attention")
    cross_entropy, adamw_step = _missing("cross_entropy"), _missing("adamw_step")
    vocab_parallel_stats = _missing("vocab_parallel_stats")
    vocab_parallel_cross_entropy = _missing("vocab_parallel_cross_entropy")
