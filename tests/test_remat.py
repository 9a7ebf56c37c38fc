"""Activation checkpointing (``--remat``): the same loss and gradients as keeping everything, with
dropout on, on every backend and under pipelines; and what it keeps falls as the policy says.

Equality: a recomputed layer draws the same dropout bits (a hash of seed, step, key and position),
runs the same ops on the same blocks, so the gradients match to the last bit or nearly (measured:
torch 0, JAX ≤ 5e-9 of gradients ~1e-1: XLA may fuse a recomputed forward differently); held to
1e-6 of the largest gradient, the issue's bar.

Memory, counted where each framework decides what the backward keeps: torch's saved-tensor hooks
(the bytes autograd holds between forward and backward), JAX's saved residuals of ``jax.vjp``.
For a GPT of L layers (activations (B, S, E) = 8 x 32 x 64 fp32: 64 KiB): ``block`` keeps each
layer's input; ``selective`` also its attention output (a (B, S, H, D) block, 64 KiB).
"""

import dataclasses

import numpy as np
import pytest

from parlay.backends.torch.launch import spawn
from parlay.core import Mesh, ProgramError, get_backend, make_program
from parlay.core.models.gpt import GPT, PRESETS

B = 8
REMATS = ("none", "block", "selective")


def _model(layers: int = 2, **changes) -> GPT:
    return GPT(dataclasses.replace(PRESETS["tiny"], layers=layers, **{"dropout": 0.1, **changes}))


def _batch(model: GPT, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    c = model.config
    return {k: rng.integers(0, c.vocab, (B, c.seq)).astype(np.int32) for k in ("tokens", "targets")}


def _loss_and_grads(session, batch):
    return session.loss_and_grads(batch)


def _assert_same(got, want, what):
    (loss, grads), (loss0, grads0) = got, want
    assert abs(loss - loss0) <= 1e-6 * abs(loss0), what
    scale = max(np.abs(g).max() for g in grads0.values())
    for k in grads0:
        np.testing.assert_allclose(grads[k], grads0[k], rtol=0, atol=1e-6 * scale, err_msg=f"{what}: {k}")


def _programs(model, strategy, axes, **kw):
    return {r: make_program(model, strategy, Mesh(**axes), batch=B, remat=r, **kw) for r in REMATS}


EXHAUSTIVE = pytest.mark.exhaustive
JAX_CASES = [pytest.param("jax-single", "dp", dict(dp=1), {}, marks=EXHAUSTIVE, id="jax-single-dp"),
             pytest.param("jax", "dp+tp", dict(dp=2, tp=2), {}, id="jax-dp+tp"),
             pytest.param("jax", "fsdp", dict(dp=4), dict(microbatches=2), marks=EXHAUSTIVE, id="jax-fsdp"),
             pytest.param("jax-gspmd", "fsdp+tp", dict(dp=2, tp=2), {}, id="jax-gspmd-fsdp+tp"),
             # the tick loop: I and W recompute a stage, and each layer inside it again
             pytest.param("jax", "pp+dp", dict(pp=2, dp=2), dict(microbatches=2, schedule="zbv"), id="jax-pp+dp"),
             pytest.param("jax-mpmd", "pp+tp", dict(pp=2, tp=2), dict(microbatches=2, schedule="1f1b"),
                          marks=EXHAUSTIVE, id="jax-mpmd-pp+tp")]


@pytest.mark.parametrize("backend, strategy, axes, kw", JAX_CASES)
def test_jax_remat_equals_keeping_everything(backend, strategy, axes, kw):
    model = _model(4 if kw.get("schedule") == "zbv" else 2)
    runs = {r: get_backend(backend).run(p, _loss_and_grads, _batch(model))
            for r, p in _programs(model, strategy, axes, **kw).items()}
    for r in ("block", "selective"):
        _assert_same(runs[r], runs["none"], f"{backend} {strategy} remat {r}")


TORCH_CASES = [("dp+tp", dict(dp=2, tp=2), {}),
               ("fsdp+tp", dict(dp=2, tp=2), dict(microbatches=2)),
               ("zero2", dict(dp=4), {}),
               ("pp+dp", dict(pp=2, dp=2), dict(microbatches=2, schedule="1f1b"))]


def torch_remat_cases(rank, cases):
    from parlay.backends.torch.session import TorchSession

    out = {}
    for strategy, axes, kw in cases:
        model = _model()
        for r, program in _programs(model, strategy, axes, **kw).items():
            out[(strategy, r)] = TorchSession(program, model.init(0)).loss_and_grads(_batch(model))
    # ZB-H1 splits each backward in two (I, then W): block remat recomputes the stage for each
    model = _model()
    for r in ("none", "block"):
        program = make_program(model, "pp+dp", Mesh(pp=2, dp=2), batch=B, microbatches=2, schedule="zb-h1", remat=r)
        out[("pp+dp zb-h1", r)] = TorchSession(program, model.init(0)).loss_and_grads(_batch(model))
    return out if rank == 0 else None


@pytest.mark.slow
def test_torch_remat_equals_keeping_everything():
    out = spawn(torch_remat_cases, 4, TORCH_CASES, timeout_s=600)[0]
    checks = [(c[0], r) for c in TORCH_CASES for r in ("block", "selective")] + [("pp+dp zb-h1", "block")]
    assert set(out) == set(checks) | {(s, "none") for s, _ in checks}
    for strategy, r in checks:
        _assert_same(out[(strategy, r)], out[(strategy, "none")], f"torch {strategy} remat {r}")
    single = {r: get_backend("torch-single").run(p, _loss_and_grads, _batch(_model()))
              for r, p in _programs(_model(), "dp", dict(dp=1)).items()}
    for r in ("block", "selective"):
        _assert_same(single[r], single["none"], f"torch-single remat {r}")


def _saved_torch(session, batch):
    """Bytes autograd keeps for the backward (its saved-tensor hooks), the loss's forward."""
    import torch

    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = session._loss(batch, training=True)
    loss.backward()
    return total[0]


def _saved_jax(session, batch):
    """Bytes of the residuals ``jax.vjp`` keeps (parameters and constants aside)."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list, as data

    from parlay.core.ops import step_words

    res = saved_residuals(lambda p: session._loss(p, session._place_batch(batch), step_words(0)),
                          session.state["params"])
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in res
               if "argument" not in why and "constant" not in why)


def test_remat_keeps_what_the_policy_says():
    x = B * 16 * 64 * 4  # a layer's input (B, S, E) in fp32; the attention output has as many elements
    saved = {}
    for layers in (2, 4):
        model = _model(layers, dropout=0.0)
        for r, program in _programs(model, "dp", dict(dp=1)).items():
            saved[("torch", layers, r)] = get_backend("torch-single").run(program, _saved_torch, _batch(model))
            saved[("jax", layers, r)] = get_backend("jax-single").run(program, _saved_jax, _batch(model))
    for fw in ("torch", "jax"):
        # two more layers: two more inputs kept under block, two inputs and two attention outputs
        # under selective; everything of two layers without remat (many inputs' worth)
        assert saved[(fw, 4, "block")] - saved[(fw, 2, "block")] == 2 * x, (fw, saved)
        if fw == "jax":  # torch's selective contexts keep their values outside autograd's hooks
            assert saved[(fw, 4, "selective")] - saved[(fw, 2, "selective")] == 4 * x, saved
        none = saved[(fw, 4, "none")] - saved[(fw, 2, "none")]
        assert none > 20 * x, (fw, none / x)


def test_torch_selective_remat_does_not_recompute_the_attention_output():
    # Count the batched matmuls the backward runs: block recomputes each layer's (q k, probs v and
    # the projections); selective takes probs v's output from what it kept.
    out = {r: get_backend("torch-single").run(p, _backward_bmms, _batch(_model()))
           for r, p in _programs(_model(), "dp", dict(dp=1)).items()}
    layers = 2
    assert out["selective"] == out["block"] - layers, out
    assert out["block"] > out["none"], out


def _backward_bmms(session, batch):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    loss = session._loss(batch, training=True)
    with Count():
        loss.backward()
    return Count.n


def test_remat_without_layers_and_selective_with_a_split_backward_are_refused():
    from parlay.core import DType, InputDecl, ParamDecl

    class Linear:
        def decls(self):
            return (ParamDecl("w", (8, 4), ("feat", "cls")),)

        def inputs(self, batch):
            return {"x": InputDecl((batch, 8), ("batch", "feat"), DType.FLOAT32),
                    "y": InputDecl((batch,), ("batch",), DType.INT32, high=4)}

        def loss(self, ops, params, batch):
            w = ops.param("w", params["w"], ("feat", "cls"))
            return ops.cross_entropy(ops.einsum("bf,fc->bc", batch["x"], w), batch["y"])

    with pytest.raises(ProgramError, match=r"remat 'block' recomputes the model's repeated layers, and Linear lacks "
                                           r"layers\(\), embed\(\), layer\(\), head\(\)"):
        make_program(Linear(), "dp", Mesh(dp=2), batch=8, remat="block")
    with pytest.raises(ValueError, match="remat 'everything' is unknown; choose from none, block, selective"):
        make_program(_model(), "dp", Mesh(dp=2), batch=8, remat="everything")
    program = make_program(_model(), "pp+dp", Mesh(pp=2, dp=2), batch=8, microbatches=2, schedule="zb-h1",
                           remat="selective")
    with pytest.raises(ValueError, match=r"--remat selective on torch keeps its saved values for one backward of each "
                                         r"layer, and zb-h1 runs two"):
        get_backend("torch").run(program, _loss_and_grads, _batch(_model()))


def test_the_cli_runs_a_step_under_remat(capsys):
    from parlay.cli import main

    assert main(["step", "--backend", "jax", "--mesh", "dp=2,tp=2", "--strategy", "fsdp+tp", "--remat", "selective",
                 "--steps", "1"]) == 0
    assert "fsdp+tp (remat selective)" in " ".join(capsys.readouterr().out.split())
