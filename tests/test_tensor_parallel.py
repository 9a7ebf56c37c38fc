"""2.5D (Tesseract) and 3D (Colossal-AI's Linear3D) tensor parallelism as rule sets: ``tp2.5d``
over (row, col, dep) and ``tp3d`` over (x, y, z), no layer code.

- The layouts are Colossal-AI's: 3D's residual stream ((y, z), x), a layer's hidden ((y, x), z),
  weights [in over (input features' axis, y), out over the other], so consecutive linears swap x
  and z and compose with one reduce-scatter between them.
- The bytes one device sends for one linear (forward and backward, from the plans) equal the
  formulas in benchmarks/tensor_parallel.py exactly: 3D 6(q-1)S/q^3 (Colossal-AI's), 2D
  4(q-1)S/q^2, 2.5D 2(q-1)(d+1)S/(dq^2) plus the weight gradient's sum over dep, 1D 2(P-1)S/P.
- The GPT under both equals one device on torch, JAX explicit, GSPMD and numpy (8 ranks, fp32,
  ``parlay compare``'s tolerances).
"""

import importlib.util
import math
import pathlib
import sys

import pytest

from parlay import Mesh
from parlay.compare import run_compare
from parlay.core.einsum import plan_einsum
from parlay.core.layers import HIDDEN, RESIDUAL
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.plan import plan_redistribute
from parlay.core.program import make_program
from parlay.core.steps import AllGather, ReduceScatter
from parlay.core.strategies import Role, get_strategy

_ROOT = pathlib.Path(__file__).parents[1]
CUBE = Mesh(x=2, y=2, z=2)


def _bench():
    name = "parlay_benchmarks_tensor_parallel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _ROOT / "benchmarks" / "tensor_parallel.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _specs(program):
    params = {k: str(v.spec) for k, v in program.layouts[Role.PARAMS].items()}
    acts = lambda dims: str(program.activation(dims, (8, 16, 64)).spec)
    return params, acts


def test_tp3d_lays_out_colossal_ais_cube():
    program = make_program(GPT(PRESETS["tiny"]), "tp3d", CUBE, batch=8)
    params, acts = _specs(program)
    assert acts(RESIDUAL) == "[(y,z), None, x]" and acts(HIDDEN) == "[(y,x), None, z]"
    assert params["blocks.0.mlp.w_in"] == "[(x,y), z]" and params["blocks.0.mlp.w_out"] == "[(z,y), x]"
    assert params["blocks.0.attn.wq"] == "[(x,y), z]" and params["blocks.0.attn.wo"] == "[(z,y), None, x]"
    n = 8 * 16 * 64
    assert math.prod(program.activation(RESIDUAL, (8, 16, 64)).local_shape((8, 16, 64))) == n // 8  # 1/q^3


def test_tp25d_splits_the_batch_over_row_and_dep_and_keeps_weights_over_row_and_col():
    program = make_program(GPT(PRESETS["tiny"]), "tp2.5d", Mesh(row=2, col=2, dep=2), batch=8)
    params, acts = _specs(program)
    assert acts(RESIDUAL) == "[(row,dep), None, col]" and acts(HIDDEN) == "[(row,dep), None, col]"
    assert params["blocks.0.mlp.w_in"] == "[row, col]" and params["blocks.0.mlp.w_out"] == "[col, row]"
    n = 8 * 16 * 64
    assert math.prod(program.activation(RESIDUAL, (8, 16, 64)).local_shape((8, 16, 64))) == n // 8  # 1/(d q^2)


def test_consecutive_3d_linears_gather_one_axis_each_and_reduce_scatter_between():
    """fc1 gathers its input over z and its weight over y and leaves a sum over x, which one
    reduce-scatter turns into the hidden's layout; fc2 does the same with x and z swapped. Square
    matrices (tokens = embed = mlp), as Colossal-AI's formula takes them: on other shapes the
    einsum rule may find another plan of equal or lower cost."""
    program = make_program(GPT(PRESETS["tiny"]), "tp3d", CUBE, batch=8)
    lay = program.layouts[Role.PARAMS]
    x_in, hidden = program.activation(RESIDUAL, (8, 16, 64)), program.activation(HIDDEN, (8, 16, 128))
    for x, w, gathered, summed, nxt in [(x_in, lay["blocks.0.mlp.w_in"], "z", "x", hidden),
                                        (hidden, lay["blocks.0.mlp.w_out"], "x", "z", x_in)]:
        e = plan_einsum("bsi,io->bso", [x, w], [(8, 16, 128), (128, 128)])
        assert [(type(s), s.axes) for s in e.operand_plans[0].steps] == [(AllGather, (gathered,))]
        assert [(type(s), s.axes) for s in e.operand_plans[1].steps] == [(AllGather, ("y",))]
        assert e.out.partial == (summed,)
        after = plan_redistribute(e.out, nxt, e.out_shape)
        assert [(type(s), s.axes) for s in after.steps] == [(ReduceScatter, (summed,))]


def test_combined_and_renamed_3d_rules_keep_flax_order():
    """``dp+tp3d`` puts the joint batch rules where tp3d's batch rules stand (after the feature
    rules), so the hidden's batch still falls back to (dp, y, x); renaming keeps the order."""
    s = get_strategy("dp+tp3d")
    mesh = Mesh(dp=2, x=2, y=2, z=2)
    assert str(s.activations.resolve(HIDDEN, mesh)) == "[(dp,y,x), None, z]"
    assert str(s.activations.resolve(RESIDUAL, mesh)) == "[(dp,y,z), None, x]"
    assert get_strategy("tp3d").axes == ("x", "y", "z")
    renamed = get_strategy("tp3d@a,b,c")
    assert str(renamed.activations.resolve(HIDDEN, Mesh(a=2, b=2, c=2))) == "[(b,a), None, c]"


@pytest.mark.parametrize("strategy, label, mesh", [
    ("tp", "1D", {"tp": 8}), ("tp", "1D", {"tp": 64}),
    ("tp2d", "2D", {"row": 2, "col": 2}), ("tp2d", "2D", {"row": 4, "col": 4}), ("tp2d", "2D", {"row": 8, "col": 8}),
    ("tp2d", "2D", {"row": 2, "col": 4}),
    ("tp2.5d", "2.5D", {"row": 2, "col": 2, "dep": 2}), ("tp2.5d", "2.5D", {"row": 4, "col": 4, "dep": 2}),
    ("tp2.5d", "2.5D", {"row": 4, "col": 4, "dep": 4}),
    ("tp3d", "3D", {"x": 2, "y": 2, "z": 2}), ("tp3d", "3D", {"x": 4, "y": 4, "z": 4}),
], ids=lambda v: "x".join(map(str, v.values())) if isinstance(v, dict) else v)
def test_one_linears_bytes_equal_the_formula(strategy, label, mesh):
    bench, n = _bench(), 64
    assert bench.linear_bytes(strategy, mesh, n) == bench.formula(label, mesh, n * n * 4)


def _compare(strategy, axes, backends):
    program = make_program(GPT(PRESETS["tiny"]), strategy, Mesh(axes), batch=8)
    _, runs = run_compare(program, steps=2, backends=tuple(backends), bisect=False)
    assert [r.name for r in runs] == list(backends)
    for run in runs:
        assert run.agree, (strategy, run.name, run.loss_diff, run.grad_diff, run.worst_grad, run.param_diff)


def test_tp3d_equals_one_device_on_every_backend():
    _compare("tp3d", {"x": 2, "y": 2, "z": 2}, ["torch", "jax", "jax-gspmd", "numpy"])


def test_tp25d_equals_one_device_on_jax_and_the_simulator():
    _compare("tp2.5d", {"row": 2, "col": 2, "dep": 2}, ["jax", "jax-gspmd", "numpy"])


@pytest.mark.exhaustive
def test_tp25d_equals_one_device_on_torch():
    _compare("tp2.5d", {"row": 2, "col": 2, "dep": 2}, ["torch"])
