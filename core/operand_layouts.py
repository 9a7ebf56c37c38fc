"""The layouts an op's operands need when each rank computes on its own block.

Backend-neutral decisions shared by every explicit executor (JAX shard_map, torch): which dims
must be whole on a rank for the local computation to be the global one, and which layout the
result then has. Einsums have their own rule (``einsum.py``); these are the other ops.
"""

from __future__ import annotations

from .spec import Layout, P

__all__ = ["vector_layout", "bias_layout", "rotary_layouts", "attention_layout", "embed_layouts", "loss_targets_layout"]


def vector_layout(x: Layout, ndim: int) -> Layout:
    """A (D,) parameter (norm scale, bias) split like ``x``'s last dim, so it applies locally."""
    return Layout(x.mesh, P(x.dim_axes(ndim - 1) or None))


def bias_layout(x: Layout, ndim: int, bias_ndim: int) -> Layout:
    """A parameter over the last ``bias_ndim`` of ``x``'s ``ndim`` dims, split like them, so it
    adds locally. Never partial; where ``x`` holds pending sums the executors add it on one
    addend only (the ranks at index 0 of ``x``'s partial axes)."""
    return Layout(x.mesh, P(*(x.dim_axes(d) or None for d in range(ndim - bias_ndim, ndim))))


def rotary_layouts(x: Layout) -> tuple[Layout, Layout]:
    """(B, S, H, D) input: head_dim whole (rotation pairs its two halves); the (S, D/2) tables
    split like the sequence."""
    target = x if not x.dim_axes(3) else Layout(x.mesh, P(*(x.dim_axes(d) or None for d in range(3))))
    return target, Layout(x.mesh, P(x.dim_axes(1) or None))


def attention_layout(q: Layout) -> Layout:
    """q, k, v (B, S, H, D): batch and heads split as q's, the sequence and head_dim whole."""
    return Layout(q.mesh, P(q.dim_axes(0) or None, None, q.dim_axes(2) or None))


def embed_layouts(table: Layout, tokens: Layout) -> tuple[Layout, Layout]:
    """(table target, output layout) of a lookup ``table[tokens]``.

    The table may not use the tokens' axes (each rank looks up its own tokens). With the
    vocabulary split, each rank adds the rows it holds and zeros elsewhere: the output is partial
    over the vocabulary's axes.
    """
    used = set(tokens.spec.axes)
    keep = lambda axes: tuple(a for a in axes if a not in used) or None
    target = Layout(table.mesh, P(keep(table.dim_axes(0)), keep(table.dim_axes(1))))
    out = Layout(table.mesh, P(tokens.dim_axes(0) or None, tokens.dim_axes(1) or None, target.dim_axes(1) or None),
                 target.dim_axes(0))
    return target, out


def loss_targets_layout(logits: Layout) -> Layout:
    """(B, S) targets split like the (B, S, V) logits' leading dims."""
    return Layout(logits.mesh, P(logits.dim_axes(0) or None, logits.dim_axes(1) or None))
