"""Explicit mode: the neutral ops on local shards inside ``shard_map``.

Every value is a ``Sharded``: this rank's block plus its core ``Layout`` and global shape. Each
op asks the core what its operands must look like (``plan_einsum``, ``plan_redistribute``),
runs those plans with ``lax`` collectives (``collectives.run_plan``), then computes locally.
Norms, softmax statistics and the vocabulary-parallel cross entropy reduce over the axes that
shard the reduced dim with ``psum``/``pmax``. The backward pass is JAX's transpose of these
collectives (shard_map tracks which values vary over which axes: DESIGN.md's variance rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import Layout, P, plan_einsum, plan_redistribute
from ...core.operand_layouts import (attention_layout, bias_layout, embed_layouts, loss_targets_layout,
                                      rotary_layouts, vector_layout)
from ...core.ops import LogicalDims
from .collectives import AtomMesh, CollectiveLog, run_plan
from .ops import JaxOps

__all__ = ["Sharded", "ExplicitOps"]


@dataclass(frozen=True)
class Sharded:
    local: jax.Array
    layout: Layout
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


class ExplicitOps:
    """``Ops`` on ``Sharded`` values; ``activation`` and ``compute`` resolve logical dims."""

    def __init__(self, atoms: AtomMesh, *, activation: Callable[[LogicalDims], P],
                 compute: Callable[[str, LogicalDims], P], log: CollectiveLog | None = None):
        self.atoms, self.mesh = atoms, atoms.mesh
        self._activation, self._compute = activation, compute
        self.log = log
        self.tap = None  # called with (plan, step index, local before, local after) for every plan step
        self._local = JaxOps()  # the same math on local blocks

    # -- moving data ---------------------------------------------------------------------------
    def redistribute(self, x: Sharded, target: Layout) -> Sharded:
        if x.layout == target:
            return x
        plan = plan_redistribute(x.layout, target, x.shape, itemsize=x.local.dtype.itemsize)
        return Sharded(run_plan(plan, x.local, self.atoms, self.log, self.tap), target, x.shape)

    def complete(self, x: Sharded) -> Sharded:
        """Sum pending partials (a nonlinear op needs whole values)."""
        return self.redistribute(x, x.layout.replace(partial=())) if x.layout.partial else x

    def _axes(self, axes) -> tuple[str, ...]:
        return self.atoms.names(axes)

    def _index(self, axes) -> jax.Array:
        return lax.axis_index(self._axes(axes)) if axes else jnp.int32(0)

    def param(self, name: str, value: Sharded, dims: LogicalDims) -> Sharded:
        return self.redistribute(value, Layout(self.mesh, self._compute(name, dims)))

    def constrain(self, x: Sharded, dims: LogicalDims) -> Sharded:
        return self.redistribute(x, Layout(self.mesh, self._activation(dims)))

    def constant(self, value) -> Sharded:
        value = np.asarray(value)
        return Sharded(jnp.asarray(value), Layout(self.mesh, P()), value.shape)

    # -- linear algebra ------------------------------------------------------------------------
    def einsum(self, equation: str, *operands: Sharded) -> Sharded:
        plan = plan_einsum(equation, [o.layout for o in operands], [o.shape for o in operands],
                           itemsize=operands[0].local.dtype.itemsize)
        locals_ = [run_plan(p, o.local, self.atoms, self.log, self.tap) for p, o in zip(plan.operand_plans, operands)]
        return Sharded(self._local.einsum(equation, *locals_), plan.out, plan.out_shape)

    def _same(self, x: Sharded, y: Sharded) -> tuple[Sharded, Sharded]:
        """Both operands in one layout: x's, complete unless both hold the same pending sums."""
        if x.layout == y.layout:
            return x, y
        x = self.complete(x)
        return x, self.redistribute(self.complete(y), x.layout)

    def add(self, x: Sharded, y: Sharded) -> Sharded:
        if x.shape != y.shape:
            raise ValueError(f"add: shapes {x.shape} and {y.shape} differ; explicit mode adds equal shapes.")
        x, y = self._same(x, y)
        return Sharded(x.local + y.local, x.layout, x.shape)

    def mul(self, x: Sharded, y: Sharded) -> Sharded:
        x, y = self._same(self.complete(x), self.complete(y))
        return Sharded(x.local * y.local, x.layout, x.shape)

    def add_bias(self, x: Sharded, b: Sharded) -> Sharded:
        """b split like x's trailing dims; where x holds pending sums, only the ranks at index 0
        of its partial axes add b (the mask makes b vary there: its gradient is psum'd back)."""
        b = self.redistribute(self.complete(b), bias_layout(x.layout, x.ndim, b.ndim))
        bias = b.local
        if x.layout.partial:
            bias = bias * (self._index(x.layout.partial) == 0).astype(bias.dtype)
        return Sharded(x.local + bias, x.layout, x.shape)

    def gelu(self, x: Sharded) -> Sharded:
        x = self.complete(x)
        return Sharded(self._local.gelu(x.local), x.layout, x.shape)

    def silu(self, x: Sharded) -> Sharded:
        x = self.complete(x)
        return Sharded(self._local.silu(x.local), x.layout, x.shape)

    # -- reductions over a possibly sharded last dim ----------------------------------------------
    def _last_dim(self, x: Sharded, *params: Sharded) -> tuple[Sharded, tuple[str, ...], list[Sharded]]:
        x = self.complete(x)
        axes = x.layout.dim_axes(x.ndim - 1)
        vec = vector_layout(x.layout, x.ndim)
        return x, axes, [self.redistribute(self.complete(p), vec) for p in params]

    def _sum_last(self, v: jax.Array, axes) -> jax.Array:
        s = jnp.sum(v, axis=-1, keepdims=True)
        return lax.psum(s, self._axes(axes)) if axes else s

    def rms_norm(self, x: Sharded, scale: Sharded, eps: float) -> Sharded:
        x, axes, (scale,) = self._last_dim(x, scale)
        ms = self._sum_last(x.local * x.local, axes) / x.shape[-1]
        return Sharded(x.local * lax.rsqrt(ms + eps) * scale.local, x.layout, x.shape)

    def layer_norm(self, x: Sharded, scale: Sharded, bias: Sharded, eps: float) -> Sharded:
        x, axes, (scale, bias) = self._last_dim(x, scale, bias)
        mean = self._sum_last(x.local, axes) / x.shape[-1]
        var = self._sum_last(jnp.square(x.local - mean), axes) / x.shape[-1]
        return Sharded((x.local - mean) * lax.rsqrt(var + eps) * scale.local + bias.local, x.layout, x.shape)

    # -- embedding, positions, attention, loss ------------------------------------------------------
    def embed(self, table: Sharded, tokens: Sharded) -> Sharded:
        """Vocabulary-parallel lookup: ranks outside a token's vocab shard add zeros."""
        tokens = self.complete(tokens)
        target, out_layout = embed_layouts(table.layout, tokens.layout)
        table = self.redistribute(self.complete(table), target)
        vocab_axes = target.dim_axes(0)
        v_local = table.local.shape[0]
        ids = tokens.local - self._index(vocab_axes) * v_local
        hit = (ids >= 0) & (ids < v_local)
        out = jnp.take(table.local, jnp.clip(ids, 0, v_local - 1), axis=0) * hit[..., None]
        return Sharded(out, out_layout, tokens.shape + (table.shape[1],))

    def rotary(self, x: Sharded, cos: Sharded, sin: Sharded) -> Sharded:
        x = self.complete(x)
        target, table = rotary_layouts(x.layout)
        x = self.redistribute(x, target)
        cos, sin = self.redistribute(cos, table), self.redistribute(sin, table)
        return Sharded(self._local.rotary(x.local, cos.local, sin.local), x.layout, x.shape)

    def attention(self, q: Sharded, k: Sharded, v: Sharded, *, causal: bool = True) -> Sharded:
        q = self.complete(q)
        target = attention_layout(q.layout)
        q, k, v = (self.redistribute(self.complete(t), target) for t in (q, k, v))
        return Sharded(self._local.attention(q.local, k.local, v.local, causal=causal), target, q.shape)

    def cross_entropy(self, logits: Sharded, targets: Sharded) -> Sharded:
        """Mean token loss; with the vocabulary sharded, max and sum-exp combine over its axes."""
        logits = self.complete(logits)
        targets = self.redistribute(self.complete(targets), loss_targets_layout(logits.layout))
        vocab = self._axes(logits.layout.dim_axes(2))
        l = logits.local  # (B/., S/., V/.)
        m = lax.stop_gradient(jnp.max(l, axis=-1, keepdims=True))
        if vocab:
            m = lax.stop_gradient(lax.pmax(m, vocab))
        se = jnp.sum(jnp.exp(l - m), axis=-1)
        picked_ids = targets.local - self._index(logits.layout.dim_axes(2)) * l.shape[-1]
        hit = (picked_ids >= 0) & (picked_ids < l.shape[-1])
        picked = jnp.take_along_axis(l, jnp.clip(picked_ids, 0, l.shape[-1] - 1)[..., None], axis=-1)[..., 0] * hit
        if vocab:
            se, picked = lax.psum(se, vocab), lax.psum(picked, vocab)
        total = jnp.sum(jnp.log(se) + m[..., 0] - picked)
        token_axes = self._axes(logits.layout.dim_axes(0) + logits.layout.dim_axes(1))
        if token_axes:
            total = lax.psum(total, token_axes)
        return Sharded(total / (logits.shape[0] * logits.shape[1]), Layout(self.mesh, P()), ())
