"""Random rule sets over random meshes for the differential tests (imported by name: conftest puts
tests/ on sys.path, and spawned torch ranks inherit it).

A case is (model name, Strategy, mesh axes). Rules are drawn per role over the model's own
logical names and one to three axes x, y, z (sizes 1, 2, 4 or 8, at most 8 ranks): a name maps to nothing, one axis
or a tuple of two (a dim split over several axes), each mapped name with a fallback to replicated.
Parameters in use are either where they are stored, gathered whole (FSDP's pattern: a gather
whose transpose is a reduce-scatter), or elsewhere (a re-slice); gradients and optimizer states
get rules of their own or follow the parameters. Activations get rules of their own at every
constraint point, so the sequence (or the patches) may be split in one region and whole in
another (gathers and re-slices between them), and contractions over split dims leave partial sums.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from parlay import DType, InputDecl, Mesh, ParamDecl, Rules
from parlay.core.loading import load_model
from parlay.core.model import RandomData
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import ProgramError, make_program
from parlay.core.shapes import trace
from parlay.core.strategies import Strategy

REPO = Path(__file__).parents[1]
MODELS = ("tiny", "tiny-gpt2-hf", "vit", "mlp")
AXES = ("x", "y", "z")
BATCH = 8


class MLP:
    """A classifier with no constraint point at all: its activations' layouts come from the
    inputs' and the einsum rule alone (a reviewer's model found a variance gap this way)."""

    def decls(self):
        return (ParamDecl("fc1.w", (16, 32), ("feat_in", "hidden")), ParamDecl("fc1.b", (32,), ("hidden",)),
                ParamDecl("fc2.w", (32, 8), ("hidden", "classes")))

    def inputs(self, batch):
        return {"x": InputDecl((batch, 16), ("samples", "feat_in"), DType.FLOAT32),
                "y": InputDecl((batch,), ("samples",), DType.INT32, high=8)}

    def loss(self, ops, params, batch):
        p = lambda n, dims: ops.param(n, params[n], dims)
        h = ops.einsum("bi,ih->bh", batch["x"], p("fc1.w", ("feat_in", "hidden")))
        h = ops.relu(ops.add_bias(h, p("fc1.b", ("hidden",))))
        return ops.cross_entropy(ops.einsum("bh,hc->bc", h, p("fc2.w", ("hidden", "classes"))), batch["y"])

    def dataset(self, files=()):
        return RandomData(self)


@lru_cache(maxsize=None)
def model(name: str):
    if name == "vit":
        return load_model(f"{REPO / 'examples' / 'vit.py'}:model")[0]
    if name == "mlp":
        return MLP()
    return GPT(PRESETS[name])


@lru_cache(maxsize=None)
def names(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(parameter dim names, activation dim names) of a model."""
    m = model(name)
    tr = trace(m, BATCH)
    params = sorted({n for d in m.decls() for n in d.dims if n})
    acts = sorted({n for d in m.inputs(BATCH).values() for n in d.dims if n} |
                  {n for dims, _ in tr.constraints for n in dims if n})
    return tuple(params), tuple(acts)


@lru_cache(maxsize=None)
def inputs(name: str):
    """The model's parameters (norm scales and biases moved off 1 and 0) and one batch."""
    from model_params import params_for

    m = model(name)
    if isinstance(m, GPT):
        params = params_for(m)
    else:  # biases and norm scales off 0 and 1
        from parlay.core.model import model_init

        params = {k: (v + 0.02 * np.random.default_rng(1).standard_normal(v.shape)).astype(np.float32)
                  for k, v in model_init(m, 0).items()}
    make = getattr(m, "dataset", None)
    batch = make().batch_at(0, BATCH, seed=0)
    return params, batch


@st.composite
def rules(draw, vocab: tuple[str, ...], pool: tuple[str, ...]) -> Rules:
    out = []
    for name in draw(st.permutations(vocab)):
        kind = draw(st.sampled_from(["none", "none", "one", "one"] + (["two"] if len(pool) > 1 else [])))
        if kind == "one":
            out.append((name, draw(st.sampled_from(pool))))
        elif kind == "two":
            out.append((name, tuple(draw(st.permutations(pool))[:2])))
        if kind != "none":
            out.append((name, None))  # a fallback where the axes are taken
    return Rules(out)


def _attempt(draw):
    """One drawn case, or None where it makes no valid Program."""
    name = draw(st.sampled_from(MODELS))
    pnames, anames = names(name)
    pool = AXES[:draw(st.integers(1, 3))]
    params = draw(rules(pnames, pool))
    compute = draw(st.sampled_from(["same", "whole", "own"]))
    strategy = Strategy(
        "random",
        params=params,
        compute=None if compute == "same" else Rules() if compute == "whole" else draw(rules(pnames, pool)),
        activations=draw(rules(anames, pool)),
        grads=draw(st.one_of(st.none(), rules(pnames, pool))),
        optimizer=draw(st.one_of(st.none(), rules(pnames, pool))),
    )
    used = [a for a in AXES if a in strategy.axes]
    sizes, room = [], 8
    for _ in used:
        options = [n for n in (1, 2, 2, 4, 4, 8) if n <= room]  # an axis of size 1 now and then
        if not options:
            return None
        sizes.append(draw(st.sampled_from(options)))
        room //= sizes[-1]
    if not used or all(n == 1 for n in sizes):
        return None
    axes = tuple(zip(used, sizes))
    try:
        make_program(model(name), strategy, Mesh(dict(axes)), batch=BATCH)
    except ProgramError:
        return None
    return name, strategy, axes


@st.composite
def cases(draw):
    """(model name, Strategy, mesh axes) that make a valid Program (drawn again where one does not)."""
    from hypothesis import assume

    for _ in range(25):
        case = _attempt(draw)
        if case is not None:
            return case
    assume(False)


def program(case):
    name, strategy, axes = case
    return make_program(model(name), strategy, Mesh(dict(axes)), batch=BATCH)


def describe(case) -> str:
    name, strategy, axes = case
    roles = {r: getattr(strategy, r) for r in ("params", "compute", "activations", "grads", "optimizer")}
    return f"{name} on {dict(axes)}: " + "; ".join(f"{r}={v!r}" for r, v in roles.items() if v is not None)


def loss_grads_step(session, batch):
    """The loss and gradients of a batch, then one AdamW step on it: the parameters after."""
    loss, grads = session.loss_and_grads(batch)
    session.step(batch)
    return loss, grads, session.params()


def torch_cases(rank, cases_):
    """On every rank of one spawn: ``loss_grads_step`` of each case of this world size."""
    from parlay.backends.torch.session import TorchSession

    out = []
    for case in cases_:
        params, batch = inputs(case[0])
        out.append(loss_grads_step(TorchSession(program(case), params), batch))
    return out if rank == 0 else None
