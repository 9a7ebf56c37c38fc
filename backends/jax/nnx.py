"""Flax NNX models under parlay's strategies, and Flax's logical-axis rules as parlay ``Rules``.

``NnxModel(make, loss, inputs)`` makes a parlay ``Model`` of an NNX module: its ``nnx.Param``s are
the parameters, named by their paths (``block.attn.kernel``), each dim named by the logical names
its ``out_sharding`` metadata carries (``nnx.with_partitioning(init, ("embed", "mlp"))`` or
``nnx.Param(value, out_sharding=...)``; none: unnamed). A parlay strategy then lays it out like
any model: parameters, optimizer states and gradients in the layouts the strategy's rules give
those names, inputs by their declared dims, and activations wherever the module calls
``constrain(x, dims)`` (identity outside a parlay run). It runs on JAX, one device or GSPMD
(``jit`` with ``NamedSharding``s: ``--backend jax --mode gspmd``); the explicit mode and torch run
parlay's executor on per-device blocks, which a Flax module does not take, and are refused.

Flax's rule lists (``flax.linen.logical_axis_rules``, MaxText's ``logical_axis_rules``) are the
form parlay's ``Rules`` take, so ``rules_from_flax`` and ``rules_to_flax`` convert both ways; a
list read from Flax resolves in Flax's order (``Rules(flax_order=True)``: rule by rule, where
parlay's own strategies go dim by dim). One Flax list serves
parameters and activations alike; a parlay strategy may place a name differently per role (FSDP
stores ``embed`` sharded and uses it whole), which ``strategy_to_flax`` lists as conflicts.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from ...core.layers import ParamDecl
from ...core.rules import RuleError, Rules
from ...core.shapes import Abstract
from ...core.strategies import Role, Strategy
from .env import use_host_devices

__all__ = ["NnxModel", "constrain", "rules_from_flax", "rules_to_flax", "strategy_from_flax", "strategy_to_flax"]

FlaxRules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]

_ops: contextvars.ContextVar = contextvars.ContextVar("parlay_nnx_ops", default=None)


# -- rules ------------------------------------------------------------------------------------------------

def rules_from_flax(rules: FlaxRules) -> Rules:
    """A Flax logical-axis rule list as parlay ``Rules`` resolved in Flax's order (rule by rule:
    ``flax_order``), so every tensor gets Flax's layout, or an error where Flax would replicate a
    dim whose every rule conflicts."""
    out, problems = [], []
    for i, item in enumerate(rules):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            problems.append(f"rule {i}: {item!r} is not a (logical name, mesh axes) pair")
            continue
        name, axes = item
        if axes is None or isinstance(axes, str):
            out.append((name, axes))
        elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
            out.append((name, tuple(axes) or None))
        else:
            problems.append(f"rule {i}: {name!r} -> {axes!r}: mesh axes are a name, a tuple of names or None")
    if problems:
        raise RuleError("these Flax logical-axis rules cannot be read:", problems)
    return Rules(out, flax_order=True)


def rules_to_flax(rules: Rules) -> list[tuple[str, str | tuple[str, ...] | None]]:
    """parlay ``Rules`` as a Flax list: one axis as its name, several as a tuple, none as None."""
    return [(n, None if not ax else ax[0] if len(ax) == 1 else tuple(ax)) for n, ax in rules.rules]


def strategy_from_flax(name: str, rules: FlaxRules) -> Strategy:
    """A parlay strategy placing parameters (stored and used), optimizer states, gradients and
    activations by one Flax rule list, as Flax does."""
    r = rules_from_flax(rules)
    return Strategy(name, params=r, activations=r)


def strategy_to_flax(strategy: Strategy) -> list[tuple[str, str | tuple[str, ...] | None]]:
    """The one Flax list that places every role as ``strategy`` does. A ``RuleError`` lists every
    logical name it places differently: among the parameter roles (stored, used, gradients,
    optimizer states: the same tensors, so a name a role leaves out is whole there), or between
    parameters and activations where both name it (FSDP, ZeRO: Flax's one list cannot say them)."""
    param_roles = (Role.PARAMS, Role.COMPUTE, Role.GRADS, Role.OPTIMIZER)
    says = lambda role, n: tuple(ax for m, ax in strategy.rules(role).rules if m == n)
    text = lambda axes: " or ".join(f"over {'x'.join(a)}" if a else "whole" for a in axes) or "whole"
    problems = []
    mentioned = list(dict.fromkeys(n for role in param_roles for n, _ in strategy.rules(role).rules))
    for n in mentioned:
        per = {role.value: says(role, n) for role in param_roles}
        if len(set(per.values())) > 1:
            problems.append(f"{n!r}: " + "; ".join(f"{role} {text(ax)}" for role, ax in per.items()))
        elif says(Role.ACTIVATIONS, n) and says(Role.ACTIVATIONS, n) != per["params"]:
            problems.append(f"{n!r}: params {text(per['params'])}; activations {text(says(Role.ACTIVATIONS, n))}")
    if problems:
        raise RuleError(f"strategy {strategy.name!r} places these logical names differently per role, which one Flax "
                        f"rule list cannot say:", problems)
    acts = Rules([(n, ax or None) for n, ax in strategy.rules(Role.ACTIVATIONS).rules if n not in mentioned])
    return rules_to_flax(strategy.rules(Role.PARAMS) + acts)


# -- models -----------------------------------------------------------------------------------------------

def constrain(x, dims: Sequence[str | None]):
    """A constraint point inside an NNX module: ``x`` laid out as the running strategy's activation
    rules place ``dims`` (GSPMD: a sharding constraint); ``x`` itself outside a parlay run."""
    ops = _ops.get()
    if ops is None:
        return x
    if isinstance(ops, _Tracing):
        ops.ops.constrain(Abstract(tuple(x.shape)), tuple(dims))  # recorded, so make_program resolves it
        return x
    return ops.constrain(x, tuple(dims))


class _Tracing:
    def __init__(self, ops):
        self.ops = ops


@contextlib.contextmanager
def _running(ops):
    token = _ops.set(ops)
    try:
        yield
    finally:
        _ops.reset(token)


class NnxModel:
    """A parlay ``Model`` of an NNX module. ``make(rngs)`` builds the module; ``loss(module,
    batch)`` is its scalar loss on a batch (a dict of arrays); ``inputs(batch)`` declares the
    batch's arrays (``{name: InputDecl}``); ``dataset(files)``, if given, is what ``parlay train``
    reads. Parameters are the module's ``nnx.Param``s; a module holding other state (batch
    statistics, RNG streams) is refused."""

    runs_on = ("jax-single", "jax-gspmd")

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], loss: Callable[[Any, Mapping[str, Any]], Any],
                 inputs: Callable[[int], Mapping[str, Any]], *, name: str | None = None,
                 dataset: Callable[..., Any] | None = None):
        self.make, self._loss, self._inputs = make, loss, inputs
        if dataset is not None:  # ``dataset(files)``: what parlay train reads (parlay.core.model.Dataset)
            self.dataset = dataset
        # Tracing the module starts JAX: ask for host devices first, as a backend's prepare does
        # (no effect where XLA_FLAGS already sets a count or JAX has started).
        use_host_devices(8)
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
            self.graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        self.name = name or type(abstract).__name__
        other = ['.'.join(map(str, p)) for p, _ in nnx.to_flat_state(rest)]
        if other:
            raise ValueError(f"{self.name} holds state that is not an nnx.Param ({', '.join(other[:4])}"
                             f"{', ...' if len(other) > 4 else ''}); NnxModel trains parameters only: keep batch "
                             f"statistics and RNG streams out of the module (pass deterministic=True, or no rngs)")
        self._flat = nnx.to_flat_state(params)
        self._names = ['.'.join(map(str, p)) for p, _ in self._flat]
        self._decls = tuple(ParamDecl(n, tuple(v.get_value().shape), self._dims(v))
                            for n, (_, v) in zip(self._names, self._flat))

    @staticmethod
    def _dims(v) -> tuple:
        names = v.get_metadata().get("out_sharding")
        shape = tuple(v.get_value().shape)
        return tuple(names) if names else (None,) * len(shape)

    def decls(self):
        return self._decls

    def inputs(self, batch: int):
        return self._inputs(batch)

    def init(self, seed: int) -> dict[str, np.ndarray]:
        with nnx.use_eager_sharding(False):
            module = self.make(nnx.Rngs(seed))
        flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
        return {'.'.join(map(str, p)): np.asarray(v.get_value(), np.float32) for p, v in flat}

    def module(self, params: Mapping[str, Any]):
        """The NNX module holding ``params`` (by name)."""
        state = nnx.from_flat_state([(p, v.replace(params[n])) for n, (p, v) in zip(self._names, self._flat)])
        return nnx.merge(self.graphdef, state)

    def loss(self, ops, params: Mapping[str, Any], batch: Mapping[str, Any]):
        first = next(iter(params.values()))
        if isinstance(first, Abstract):  # make_program traces on shapes: run the module abstractly
            for d in self._decls:
                ops.param(d.name, params[d.name], d.dims)
            specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype.numpy) for k, v in batch.items()}
            weights = {d.name: jax.ShapeDtypeStruct(d.shape, np.float32) for d in self._decls}
            with _running(_Tracing(ops)):
                out = jax.eval_shape(lambda w, b: self._loss(self.module(w), b), weights, specs)
            return ops.constant(np.zeros(out.shape, np.float32))
        if not isinstance(first, jax.Array):
            raise ValueError(f"{self.name} is a Flax NNX model: it runs on JAX's global arrays (--backend jax --mode "
                             f"gspmd, or compare --backends jax-gspmd), not on {type(first).__name__} blocks")
        used = {d.name: ops.param(d.name, params[d.name], d.dims) for d in self._decls}
        with _running(ops):
            return self._loss(self.module(used), batch)
