"""Strategies over named axes (``NAME@AXES``, ``Strategy.on``): a strategy renamed onto other mesh
axes computes what it computed on its own, and two data strategies over two axes make hybrid
sharding (HSDP: parameters sharded within a group of ranks, replicated across groups)."""

import numpy as np
import pytest

from parlay.backends.torch.launch import spawn
from parlay.core import Mesh, get_backend, make_program
from parlay.core.loading import load_strategy
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.strategies import STRATEGIES, Role, get_strategy

MODEL = GPT(PRESETS["tiny"])


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 256, (8, 16)).astype(np.int32) for k in ("tokens", "targets")}


def _loss_and_grads(session, batch):
    return session.loss_and_grads(batch)


def test_on_renames_every_role_and_nothing_else():
    for name, s in STRATEGIES.items():
        new = tuple(f"a{i}" for i in range(len(s.axes)))
        moved = s.on(*new)
        assert moved.name == f"{name}@{','.join(new)}" and moved.axes == new
        back = dict(zip(new, s.axes))
        for role in Role:
            assert [(n, tuple(back[a] for a in ax)) for n, ax in moved.rules(role).rules] == list(s.rules(role).rules)
    hsdp = get_strategy("dp@replica+fsdp@shard")
    assert hsdp.rules(Role.PARAMS).rules == (("embed", ("shard",)),)
    assert hsdp.rules(Role.ACTIVATIONS).rules[0] == ("batch", ("replica", "shard"))  # the batch over both
    assert load_strategy("examples/vit.py:FSDP@shard").rules(Role.PARAMS).rules[0][1] == ("shard",)


@pytest.mark.parametrize("name, match", [
    ("fsdp@a,b", r"strategy fsdp@a,b: fsdp uses 1 mesh axis\(es\) \['dp'\]; give as many, e.g. fsdp@x"),
    ("tp2d@x,x", r"\['x', 'x'\] names an axis twice"),
    ("dp@", r"mesh axis names are identifiers; got \[''\]"),
    ("dp@tp+tp", r"cannot combine 'dp@tp' and 'tp': both use mesh axis \['tp'\]"),
    ("dpp@x", r"unknown strategy 'dpp'"),
])
def test_bad_axes_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        load_strategy(name)


def test_a_renamed_strategy_computes_what_the_original_does():
    # tp@model+dp@data on data=2,model=2 is dp+tp on dp=2,tp=2 with other names: the same numbers
    renamed = make_program(MODEL, "tp@model+dp@data", Mesh(data=2, model=2), batch=8)
    original = make_program(MODEL, "dp+tp", Mesh(dp=2, tp=2), batch=8)
    a = get_backend("numpy").run(renamed, _loss_and_grads, _batch())
    b = get_backend("numpy").run(original, _loss_and_grads, _batch())
    assert a[0] == b[0]
    for k in b[1]:
        np.testing.assert_array_equal(a[1][k], b[1][k], err_msg=k)


def hsdp_collectives(rank, program, batch):
    from parlay.backends.torch.session import TorchSession

    session = TorchSession(program, program.init(0))
    session.step(batch)
    return (session.log.counts(backward=False), session.log.counts(backward=True)) if rank == 0 else None


@pytest.mark.slow
def test_hybrid_sharding_equals_one_device_and_reduces_within_then_across_groups():
    from parlay.compare import run_compare
    from parlay.core.log import Kind

    program = make_program(MODEL, "dp@replica+fsdp@shard", Mesh(replica=2, shard=2), batch=8)
    ref, runs = run_compare(program, steps=2, backends=("numpy", "jax", "jax-gspmd", "torch"), bisect=False)
    assert all(r.agree for r in runs), [(r.name, r.loss_diff, r.grad_diff, r.param_diff) for r in runs]
    forward, backward = spawn(hsdp_collectives, 4, program, _batch(), timeout_s=300)[0]
    # parameters gathered within a group (shard) only; gradients reduce-scattered within it and
    # all-reduced across groups (replica); no gradient collective spans both axes
    assert {axes for kind, axes in forward if kind is Kind.ALL_GATHER} == {("shard",)}
    assert {(kind, axes) for kind, axes in backward} == {(Kind.REDUCE_SCATTER, ("shard",)),
                                                         (Kind.ALL_REDUCE, ("replica",))}
