"""``core.remat`` on torch: a layer under non-reentrant ``torch.utils.checkpoint``; ``selective``
keeps the attention op's output through the selective-checkpoint contexts (torchtitan's SAC)."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...core.remat import Remat, on_blocks

__all__ = ["torch_checkpoint", "saved"]

_state = threading.local()


@contextlib.contextmanager
def saved(name: str):
    """Ops run inside are the value ``name`` (core.remat.SAVED): selective remat keeps their outputs."""
    before = getattr(_state, "name", None)
    _state.name = name
    try:
        yield
    finally:
        _state.name = before


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if getattr(_state, "name", None) else CheckpointPolicy.PREFER_RECOMPUTE


def torch_checkpoint(remat: Remat) -> Callable | None:
    """``checkpoint(fn, x)`` for ``core.remat.remat_loss``: ``fn(x)`` whose backward recomputes it from
    ``x`` (its local tensor for the executor's ``Sharded``), keeping the saved values' outputs
    under ``selective``."""
    if remat is Remat.NONE:
        return None
    context = functools.partial(create_selective_checkpoint_contexts, _policy) if remat is Remat.SELECTIVE else None
    kwargs = {"use_reentrant": False, **({"context_fn": context} if context else {})}
    return on_blocks(lambda fn, x: checkpoint(fn, x, **kwargs))
