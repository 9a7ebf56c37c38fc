"""Activation checkpointing (remat): which of a block's values the backward keeps, and which it
recomputes from the block's input.

A policy applies per repeated layer of a ``PipelineModel`` (``layer(ops, params, i, x)``):

- ``none``: every value the backward needs is kept (the default);
- ``block``: only each layer's input is kept; the backward runs the layer's forward again
  (Chen et al. 2016: the activations of L layers fall to L inputs plus one layer's values);
- ``selective``: each layer's input and its *named* values are kept (``SAVED``: the attention
  op's output), the rest recomputed (torchtitan's selective AC, jax's ``save_only_these_names``).

The model's loss under a policy is ``head(layer(L-1, ... layer(0, embed(batch)))...)`` with each
layer run through the backend's ``checkpoint(fn, x)``: torch's non-reentrant
``torch.utils.checkpoint`` (selective: its selective-checkpoint contexts), ``jax.checkpoint``
with a policy. Recomputing is exact: dropout masks are a hash of (seed, step, key, position),
not a generator's state, so the recomputed forward draws the same bits (the bug OLMo-core
PR #828 and pytorch#190717 hit with stateful generators cannot happen here). The collectives of a
recomputed layer run again in the backward (full remat re-communicates, as Megatron's does).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping

__all__ = ["Remat", "REMATS", "SAVED", "remat_loss", "run_layers", "check_remat", "on_blocks"]

SAVED = ("attention",)  # the values ``selective`` keeps: the attention op's output


class Remat(enum.Enum):
    NONE = "none"
    BLOCK = "block"
    SELECTIVE = "selective"


REMATS = tuple(r.value for r in Remat)


def parse_remat(remat) -> Remat:
    if isinstance(remat, Remat):
        return remat
    try:
        return Remat(str(remat).lower())
    except ValueError:
        raise ValueError(f"remat {remat!r} is unknown; choose from {', '.join(REMATS)}.") from None


def check_remat(model, remat: Remat) -> list[str]:
    """Why ``model`` cannot run under ``remat`` (empty: it can)."""
    if remat is Remat.NONE:
        return []
    missing = [m for m in ("layers", "embed", "layer", "head") if not callable(getattr(model, m, None))]
    if missing:
        return [f"remat {remat.value!r} recomputes the model's repeated layers, and {type(model).__name__} lacks "
                f"{', '.join(f'{m}()' for m in missing)}: split its loss into embed(ops, params, batch), "
                f"layer(ops, params, i, x) for i < layers() and head(ops, params, x, batch) "
                f"(parlay.core.pipeline.PipelineModel), or run it with --remat none"]
    return []


def remat_loss(model, remat: Remat, ops, params: Mapping[str, Any], batch: Mapping[str, Any],
               checkpoint: Callable[[Callable, Any], Any] | None) -> Any:
    """The model's loss, each repeated layer through ``checkpoint(fn, x)`` under a policy (the
    backend's wrapper: it returns ``fn(x)`` and makes the backward recompute it)."""
    if remat is Remat.NONE or checkpoint is None:
        return model.loss(ops, params, batch)
    x = run_layers(model, remat, ops, params, range(int(model.layers())), model.embed(ops, params, batch), checkpoint)
    return model.head(ops, params, x, batch)


def run_layers(model, remat: Remat, ops, params, layers, x, checkpoint: Callable | None):
    """``layers`` of ``model`` on ``x`` (a pipeline stage's), each through ``checkpoint`` under a policy."""
    for i in layers:
        if remat is Remat.NONE or checkpoint is None:
            x = model.layer(ops, params, i, x)
        else:
            x = checkpoint(lambda h, i=i: _fresh(ops, lambda: model.layer(ops, params, i, h)), x)
    return x


def _fresh(ops, fn):
    """``fn()`` with the executor's kept moves dropped before and after (``ShardedOps.forget``): a
    value moved outside a checkpointed layer is not reused inside it, nor one of its values after."""
    forget = getattr(ops, "forget", None)
    if forget is not None:
        forget()
    try:
        return fn()
    finally:
        if forget is not None:
            forget()


def on_blocks(checkpoint: Callable[[Callable, Any], Any]) -> Callable[[Callable, Any], Any]:
    """A backend's ``checkpoint(fn, array)`` made to take the executor's ``Sharded`` values too: the
    local block goes through the framework's checkpoint, the layout around it."""
    import dataclasses

    from .executor import Sharded

    def run(fn, x):
        if not isinstance(x, Sharded):
            return checkpoint(fn, x)
        out = {}

        def local(block):
            out["value"] = fn(dataclasses.replace(x, local=block))
            return out["value"].local

        y = checkpoint(local, x.local)
        return dataclasses.replace(out["value"], local=y)

    return run
