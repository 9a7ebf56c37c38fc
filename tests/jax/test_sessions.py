"""Both JAX modes (GSPMD and explicit shard_map on the core executor): every strategy's loss,
gradients and five AdamW steps equal the single device.

Tolerances (fp32): the loss and gradients are sums over the same terms in another order, so
they agree to a few ulps of their largest terms: loss to 1e-5 relative, each gradient to 1e-5 of
its largest element; the losses of all five AdamW steps to 1e-5 relative.

Parameters after the steps are compared per tensor, as the L2 norm of the difference over the L2
norm of the distance the reference moved, at most 2e-3. Not element by element: an element whose
gradient is near Adam's eps (1e-8) gets an update lr * g / (|g| + eps), which turns 1e-8 of
summation-order noise into a step of up to lr. Measured on dp=4: 10 of 106,816 elements differ by
more than 1e-6 after one step, 150 after five; the worst tensor's relative difference is 2.2e-4
(tp2d, blocks.1.attn.wo). A wrong gradient in any tensor gives a relative difference of order 1.
"""

import numpy as np
import pytest

from parlay import Mesh
from parlay.backends.jax.session import JaxSession, Mode
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.optim import OptimizerConfig
from parlay.core.program import ProgramError, make_program
from parlay.core.session import get_backend

STEPS = 5
OPT = OptimizerConfig(lr=1e-3)

# (preset, strategy, mesh, whether five AdamW steps are checked too: on a few cases, since the
# optimizer's code is the same for every strategy and each check compiles a second program)
CASES = [
    # 4 devices
    ("tiny-gqa", "dp", Mesh(dp=4), False),
    ("tiny-gqa", "zero1", Mesh(dp=4), True),
    ("tiny-gqa", "zero2", Mesh(dp=4), False),
    ("tiny-gqa", "tp", Mesh(tp=4), False),
    ("tiny-gqa", "tp_sp", Mesh(tp=4), False),
    ("tiny-gqa", "ulysses", Mesh(sp=4), False),
    ("tiny-gqa", "tp2d", Mesh(row=2, col=2), False),
    ("tiny-gqa", "fsdp+tp", Mesh(dp=2, tp=2), True),
    ("tiny-gpt2", "dp+tp_sp", Mesh(dp=2, tp=2), True),
    # 8 devices (random rule sets on 8 ranks: tests/test_differential.py)
    ("tiny-gqa", "fsdp+tp", Mesh(dp=2, tp=4), False),
    ("tiny-gqa", "dp+tp+ulysses", Mesh(dp=2, tp=2, sp=2), False),
    ("tiny-gqa", "tp2d", Mesh(row=2, col=4), True),
]


def _batch(config, seed=0, batch=8):
    tokens = np.random.default_rng(seed).integers(0, config.vocab, (batch, config.seq + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _session(model, strategy, mesh, mode, params, batch=8):
    return JaxSession(make_program(model, strategy, mesh, batch=batch, optimizer=OPT), mode, params)


def _run(session: JaxSession, batch):
    loss, grads = session.loss_and_grads(batch)
    losses = [session.step(batch) for _ in range(STEPS)]
    return loss, grads, losses, session.params()


@pytest.fixture(scope="module")
def reference():
    out = {}
    for preset in {c[0] for c in CASES}:
        model = GPT(PRESETS[preset])
        params = model.init(seed=0)
        batch = _batch(model.config)
        out[preset] = (model, params, batch, _run(_session(model, "dp", Mesh(dp=1), Mode.SINGLE, params), batch))
    return out


@pytest.mark.parametrize("mode", [Mode.GSPMD, Mode.EXPLICIT], ids=lambda m: m.value)
@pytest.mark.parametrize("preset, strategy, mesh, train", CASES,
                         ids=[f"{s}-{'x'.join(map(str, m.sizes))}-{p}" for p, s, m, _ in CASES])
def test_strategy_equals_single_device(reference, preset, strategy, mesh, train, mode):
    model, params, batch, (loss0, grads0, losses0, params0) = reference[preset]
    session = _session(model, strategy, mesh, mode, params)
    loss, grads = session.loss_and_grads(batch)
    assert abs(loss - loss0) <= 1e-5 * abs(loss0)
    for name, g0 in grads0.items():
        np.testing.assert_allclose(grads[name], g0, rtol=0, atol=1e-5 * np.abs(g0).max(), err_msg=name)
    if not train:
        return
    losses = [session.step(batch) for _ in range(STEPS)]
    final = session.params()
    np.testing.assert_allclose(losses, losses0, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    for name, p0 in params0.items():
        moved = np.linalg.norm(p0 - params[name])
        assert moved > 0, name
        assert np.linalg.norm(final[name] - p0) <= 2e-3 * moved, name


def test_explicit_forward_issues_the_textbook_collectives(reference):
    """The plan steps explicit mode runs in one forward: Megatron's f/g, SP's gather/scatter,
    Ulysses' all-to-alls and FSDP's gathers, from layouts alone."""
    model, params, batch, _ = reference["tiny-gqa"]
    layers = model.config.layers
    expected = {
        ("tp", Mesh(tp=4)): {("all-reduce", ("tp",)): 1 + 2 * layers},  # embedding + attn/mlp outputs
        ("tp_sp", Mesh(tp=4)): {("reduce-scatter", ("tp",)): 1 + 2 * layers, ("all-gather", ("tp",)): 1 + 2 * layers},
        ("ulysses", Mesh(sp=4)): {("all-to-all", ("sp",)): 4 * layers},  # q, k, v there and o back
        ("fsdp", Mesh(dp=4)): {("all-gather", ("dp",)): len(params)},  # every parameter, once
        ("dp", Mesh(dp=4)): {},
    }
    for (strategy, mesh), want in expected.items():
        session = _session(model, strategy, mesh, Mode.EXPLICIT, params)
        session.log.clear()
        session.eval_loss(batch)  # traced once: the log holds one forward's plan steps
        got = {(k.value, axes): n for (k, axes), n in session.log.counts().items()}
        assert got == want, strategy


def test_bad_combinations_fail_before_anything_runs():
    model = GPT(PRESETS["tiny-gqa"])
    with pytest.raises(ProgramError, match=r"logical dim 'kv_heads' has size 4, not divisible by 8 \(tp=8\)"):
        make_program(model, "tp", Mesh(tp=8), batch=8)
    with pytest.raises(ValueError, match=r"Mesh\(dp=16\) needs 16 devices but JAX sees 8"):
        get_backend("jax").run(make_program(model, "dp", Mesh(dp=16), batch=16), lambda s: None)
    with pytest.raises(ValueError, match=r"Mesh\(dp=16\) needs 16 devices but JAX sees 8"):
        get_backend("jax-gspmd").run(make_program(model, "dp", Mesh(dp=16), batch=16), lambda s: None)
    with pytest.raises(ValueError, match=r"Mesh\(dp=128\) has 128 ranks; JAX runs at most 64 host devices here"):
        get_backend("jax").run(make_program(model, "dp", Mesh(dp=128), batch=128), lambda s: None)
    session = _session(model, "dp", Mesh(dp=4), Mode.EXPLICIT, model.init(0))
    with pytest.raises(ValueError, match=r"input 'tokens' has shape \(6, 16\); the program expects \(8, 16\)"):
        session.step(_batch(model.config, batch=6))


# Hugging Face's GPT-2 (learned positions, biases, tied embedding): loss and gradients on both
# modes; the AdamW steps above are the same code for any parameters. (zero1's loss and gradients
# are dp's by definition: it differs only in the optimizer's layout.) Random rule sets on this
# preset run on every backend in tests/test_differential.py, so tp_sp and tp2d here run only under
# `make test-all`.
HF_CASES = [pytest.param("tp_sp", Mesh(tp=4), marks=pytest.mark.exhaustive, id="tp_sp-4"),
            pytest.param("tp2d", Mesh(row=2, col=2), marks=pytest.mark.exhaustive, id="tp2d-2x2"),
            pytest.param("fsdp+tp", Mesh(dp=2, tp=2), id="fsdp+tp-2x2")]


@pytest.fixture(scope="module")
def hf_reference():
    from model_params import params_for

    model = GPT(PRESETS["tiny-gpt2-hf"])
    params = params_for(model)
    batch = _batch(model.config, seed=3)
    return model, params, batch, _session(model, "dp", Mesh(dp=1), Mode.SINGLE, params).loss_and_grads(batch)


@pytest.mark.parametrize("mode", [Mode.GSPMD, Mode.EXPLICIT], ids=lambda m: m.value)
@pytest.mark.parametrize("strategy, mesh", HF_CASES)
def test_hf_gpt2_preset_equals_single_device(hf_reference, strategy, mesh, mode):
    """Biases on partial sums (added on one addend), the position table, and the embedding used
    twice (its gradient is the sum of both uses). Measured: loss 9e-8 relative, gradients 2e-6
    of their largest element."""
    from model_params import grad_atol

    model, params, batch, (loss0, grads0) = hf_reference
    loss, grads = _session(model, strategy, mesh, mode, params).loss_and_grads(batch)
    assert abs(loss - loss0) <= 1e-5 * abs(loss0)
    assert set(grads) == set(grads0) and "lm_head.w" not in grads
    for name, g0 in grads0.items():
        np.testing.assert_allclose(grads[name], g0, rtol=0, atol=grad_atol(name, g0, grads0), err_msg=name)


class _MemoryCheckpoint:
    """What ``Session.restore`` reads from a checkpoint: global arrays by name and the update count."""

    def __init__(self, tensors, count):
        self.tensors, self._count = tensors, count

    def read(self, name, index=None, *, shape):
        return self.tensors[name] if index is None else self.tensors[name][index]

    def count(self):
        return self._count


def test_steps_past_2_31_updates_equal_numpy():
    """A cosine schedule over 2**32 updates and a run restored at update 2**31 - 1, with dropout:
    two steps cross int32's limit and take numpy's steps (once: OverflowError at the first update,
    from the schedule's int32 count; the step after 2**31 - 1 overflowed the dropout key too)."""
    import dataclasses

    from parlay.backends.numpy.session import NumpySession

    model = GPT(dataclasses.replace(PRESETS["tiny"], dropout=0.1))
    params = model.init(seed=0)
    batch = _batch(model.config)
    opt = OptimizerConfig(lr=1e-3, warmup=0, decay_steps=2**32)
    ckpt = _MemoryCheckpoint({**{f"params/{k}": v for k, v in params.items()},
                              **{f"opt/{m}/{k}": np.full_like(v, 1e-4) for m in ("mu", "nu") for k, v in params.items()}},
                             count=2**31 - 1)
    runs = []
    for make in (lambda p: NumpySession(p, params), lambda p: JaxSession(p, Mode.EXPLICIT, params)):
        session = make(make_program(model, "dp", Mesh(dp=2), batch=8, optimizer=opt))
        session.restore(ckpt)
        losses = [session.step(batch) for _ in range(2)]
        runs.append((losses, session.params(), session.checkpoint_tensors()[2]))
    (ref_losses, ref_params, ref_count), (losses, got, count) = runs
    assert count == ref_count == 2**31 + 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in params:  # per tensor, against the distance moved (see the module's docstring)
        moved = np.linalg.norm(ref_params[k] - params[k])
        assert np.linalg.norm(got[k] - ref_params[k]) <= 2e-3 * moved, k
