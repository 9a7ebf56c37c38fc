"""The executor's ``Comm`` inside ``shard_map``: plan steps on ``lax`` collectives over the prime
atoms of the mesh, ``vary`` as ``lax.pcast(..., to="varying")``.

JAX tracks which values vary over which axes itself (shard_map's varying manual axes), and that
is what its transposes follow. ``check`` holds the executor's bookkeeping to it: a value JAX says
varies over an axis must vary there in the executor's account too, or the torch and numpy
backends, which follow the account, would transpose it wrongly.
"""

from __future__ import annotations

import jax
from jax import lax

from ...core.executor import Sharded
from ...core.log import CollectiveLog
from ...core.steps import Kind, Step, collective_bytes
from .collectives import ppermute, run_step
from .mesh import AtomMesh
from .ops import JaxLocal

__all__ = ["JaxComm", "VarianceMismatch", "custom_op"]


def custom_op(fwd, bwd, *xs):
    """``Comm.custom`` on JAX: ``fwd(*xs) -> (out, res)``, ``bwd(res, g) -> grads`` as a ``custom_vjp``.

    Inside ``shard_map`` a ``custom_vjp``'s gradients must vary over exactly the axes of their
    inputs. The inputs are first made to vary alike (a ``pcast``, whose transpose sums the
    gradient back over the axes an input did not vary over), so the gradients, computed from all
    of them, vary as the inputs do. The executor's account can call a value varying over a size-1
    axis where JAX does not (``_vary_to``): this is where that difference would otherwise show.
    """
    union = frozenset().union(*(_vma(x) for x in xs))
    xs = tuple(lax.pcast(x, tuple(sorted(union - _vma(x))), to="varying") if union - _vma(x) else x for x in xs)

    def fit(g):  # a gradient computed from invariant residuals only: make it vary like its input
        missing = tuple(sorted(union - _vma(g)))
        return lax.pcast(g, missing, to="varying") if missing else g

    f = jax.custom_vjp(lambda *args: fwd(*args)[0])
    f.defvjp(fwd, lambda res, g: tuple(fit(d) for d in bwd(res, g)))
    return f(*xs)


try:  # Varying -> Invariant, JAX's own transpose of a slice of an invariant value (not exported by lax)
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - another JAX: the slice transposes to a sum (2x the bytes)
    _all_gather_invariant = None


class VarianceMismatch(AssertionError):
    """JAX says a value varies over an axis the executor calls invariant."""


def _vma(x) -> frozenset:
    """The mesh axes JAX says ``x`` varies over (``aval.vma`` in older JAX, ``manual_axis_type``'s
    ``varying`` now)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(vma)


class JaxComm:
    def __init__(self, atoms: AtomMesh, log: CollectiveLog | None = None):
        self.atoms, self.mesh, self.log = atoms, atoms.mesh, log
        self.local = JaxLocal()

    def run_step(self, step: Step, x, plan_mesh):
        out = run_step(step, x, self.atoms.names(getattr(step, "axes", ()), plan_mesh), self.atoms.atom_names)
        if self.log is not None:  # at trace time: what one device sends (the busiest, for a permute)
            axes = getattr(step, "axes", ())
            n = plan_mesh.group_size(axes) if axes else 2
            self.log.record(step.kind, axes, collective_bytes(step.kind, n, x.size, x.dtype.itemsize), dtype=x.dtype)
        return out

    def slice_shared(self, step, x, plan_mesh):
        """The slice of a value every member of the group holds, its gradient's blocks gathered
        (an all-gather that leaves it invariant): torch's transpose and the plan's. The slice of a
        varied value would transpose to a sum of the zero-padded gradient: twice the bytes."""
        base = tuple({a.partition(".")[0] for a in step.axes})
        run = lambda v: self.run_step(step, self.vary(v, base), plan_mesh)
        if _all_gather_invariant is None:
            return run(x)
        names = self.atoms.names(step.axes, plan_mesh)
        sliced = jax.custom_vjp(run)
        sliced.defvjp(lambda v: (run(v), None),
                      lambda _, g: (_all_gather_invariant(g, names, axis=step.dim, tiled=True),))
        return sliced(x)

    def vary(self, x, axes, *, param=None):
        names = tuple(n for n in self.atoms.names(axes) if n not in _vma(x))
        return lax.pcast(x, names, to="varying") if names else x

    def _reduced(self, x, axes) -> tuple[str, ...]:
        """The atoms to reduce ``x`` over: a size-1 atom ``x`` does not vary over is left out (a
        sum over one member is the identity, and JAX refuses one over an invariant axis)."""
        sizes = dict(self.atoms.atom_axes)
        vma = _vma(x)
        return tuple(n for n in self.atoms.names(axes) if n in vma or sizes[n] > 1)

    def psum(self, x, axes):
        names = self._reduced(x, axes)
        return lax.psum(x, names) if names else x

    def pmax(self, x, axes):
        names = self._reduced(x, axes)
        x = lax.stop_gradient(x)
        return lax.stop_gradient(lax.pmax(x, names)) if names else x

    def axis_index(self, axes):
        return lax.axis_index(self.atoms.names(axes))

    def all_gather_many(self, xs, dims, axes):
        names = self.atoms.names(axes)
        return [lax.all_gather(x, names, axis=d, tiled=True) for x, d in zip(xs, dims)]

    def shift(self, x, axes, *, backward: bool = False):
        names = self.atoms.names(axes)
        n = self.mesh.group_size(axes)
        if self.log is not None:
            self.log.record(Kind.PERMUTE, tuple(axes), x.size * x.dtype.itemsize, backward, dtype=x.dtype)
        return ppermute(x, names, [(j, (j + 1) % n) for j in range(n)], self.atoms.atom_names)

    def custom(self, fwd, bwd, *xs):
        return custom_op(fwd, bwd, *xs)

    def check(self, x: Sharded) -> None:
        ours = set(self.atoms.names(x.varying))
        extra = sorted(_vma(x.local) - ours)
        if extra:
            raise VarianceMismatch(f"JAX says a value of layout {x.layout} and shape {x.shape} varies over {extra}, but "
                                   f"the executor's account says it varies over {sorted(x.varying)} only; the "
                                   f"variance rule in core/executor.py missed a step.")
