"""``core.remat`` on JAX: a layer under ``jax.checkpoint`` with the policy's saveable values."""

from __future__ import annotations

from typing import Callable

import jax

from ...core.remat import SAVED, Remat, on_blocks

__all__ = ["jax_checkpoint"]


def jax_checkpoint(remat: Remat) -> Callable | None:
    """``checkpoint(fn, x)`` for ``core.remat.remat_loss``: ``fn(x)`` under ``jax.checkpoint``, keeping
    nothing of the layer (``block``) or only the values named in ``SAVED`` (``selective``; the
    attention op marks its output with ``checkpoint_name``). ``x`` is an array (single, GSPMD) or
    the executor's ``Sharded`` block (explicit): its local array goes through, its layout around."""
    if remat is Remat.NONE:
        return None
    policy = (jax.checkpoint_policies.save_only_these_names(*SAVED) if remat is Remat.SELECTIVE
              else jax.checkpoint_policies.nothing_saveable)
    return on_blocks(lambda fn, x: jax.checkpoint(fn, policy=policy)(x))
