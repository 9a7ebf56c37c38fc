"""Mixed precision (``--precision``, core/precision.py): bf16 and fp16 runs equal the same
framework's single-device run in the same precision, stay near float32, sum in float32, and fp16
survives an overflow.

Tolerances, from the unit roundoff u of the compute dtype (bf16 2^-8, fp16 2^-11), as
``compare.Tolerance.of`` derives them: two correct runs round at different points (a
tensor-parallel partial sum rounded before its float32 sum, a data-parallel gradient rounded per
shard), so values differ by a few roundings. Step-1 gradients: 4u per tensor (L2 of the
difference over L2 of the reference; measured at most 2.0u, bf16, five strategies on torch, JAX
explicit and GSPMD). The loss, a float32 mean over 1024 tokens where independent roundings
average out: u/4 relative at every one of 20 steps (measured at most 0.07u). bf16 against float32
is held to the same u/4 (measured 0.044u over 20 steps of the tiny GPT). A layout bug moves
gradients by their own size: the planted dropped all-reduce is shown to fail the bf16 tolerance.
"""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parlay.backends.torch.launch import spawn
from parlay.compare import Tolerance, compare_batches, compare_steps, run_compare
from parlay.core import Mesh, ProgramError, get_backend
from parlay.core.program import program_from
from parlay.core.executor import Fault
from parlay.core.log import Source
from parlay.core.precision import FP32, LossScale, Precision, parse_precision
from parlay.core.steps import Kind

U_BF16 = 2.0 ** -8
BF16 = Tolerance.of(parse_precision("bf16"))
SUMS = (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER)  # gathers: their transposes sum


def _rel(a: dict, b: dict) -> float:
    return max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])) for k in b)


def _curve_diff(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_the_tolerances_follow_the_unit_roundoff():
    assert (BF16.loss, BF16.grad) == (U_BF16 / 4, 4 * U_BF16)
    fp16 = Tolerance.of(parse_precision("fp16"))
    assert fp16.grad == 4 * 2.0 ** -11
    assert Tolerance.of(FP32) == Tolerance()


# -- bf16 equals its own single device, and stays near float32 ---------------------------------------

CASES = [
    pytest.param("tiny", "dp+tp", dict(dp=2, tp=2), "bf16", id="tiny-dp+tp"),
    pytest.param("examples/vit.py:model", "examples/vit.py:FSDP", dict(dp=4), "bf16", id="vit-fsdp"),
    pytest.param("tiny", "tp_sp", dict(tp=4), "bf16", marks=pytest.mark.exhaustive, id="tiny-tp_sp"),
    pytest.param("tiny", "zero2+tp", dict(dp=2, tp=2), "bf16", marks=pytest.mark.exhaustive, id="tiny-zero2+tp"),
    pytest.param("tiny-gqa", "fsdp+tp", dict(dp=2, tp=2), "bf16", marks=pytest.mark.exhaustive, id="gqa-fsdp+tp"),
    pytest.param("tiny", "ulysses", dict(sp=4), "bf16", marks=pytest.mark.exhaustive, id="tiny-ulysses"),
    pytest.param("tiny", "tp2d", dict(row=2, col=2), "bf16", marks=pytest.mark.exhaustive, id="tiny-tp2d"),
    pytest.param("tiny", "dp@replica+fsdp@shard", dict(replica=2, shard=2), "bf16", marks=pytest.mark.exhaustive,
                 id="tiny-hsdp"),
    # Megatron-LM's policy: the activations' sums in bfloat16, each rounded (core/precision.py)
    pytest.param("tiny", "tp_sp", dict(tp=4), "bf16-sum16", id="tiny-tp_sp-sum16"),
    pytest.param("tiny", "dp+tp", dict(dp=2, tp=2), "bf16-sum16", marks=pytest.mark.exhaustive,
                 id="tiny-dp+tp-sum16"),
]


@pytest.mark.parametrize("model,strategy,axes,precision", CASES)
def test_bf16_equals_the_single_device_bf16_run_over_20_steps(model, strategy, axes, precision):
    """torch, JAX explicit and GSPMD in bf16, each held to its own framework on one device in
    bf16 (step-1 gradients, 20 losses, the parameters after), and the bf16 curve near fp32's."""
    program = program_from(model, strategy, Mesh(axes), batch=8, precision=precision)
    ref, runs = run_compare(program, steps=20, backends=("jax", "jax-gspmd", "torch"), bisect=False)
    for run in runs:
        assert run.reference == ("torch-single" if run.name == "torch" else "jax-single")
        assert run.agree, (run.name, run.loss_diff, run.grad_diff, run.param_diff)
        assert run.grad_diff > 0, f"{run.name}: bitwise equal to one device; was bf16 in effect?"
    fp32 = get_backend("jax-single").run(program.replace(precision="fp32"), compare_steps,
                                         compare_batches(program, 20, 0), params=program.init(0))[0]
    assert _curve_diff(ref.losses, fp32) <= U_BF16 / 4
    assert ref.losses != fp32  # the reference did compute in bf16


def test_a_layout_bug_is_outside_the_bf16_tolerance():
    """The tolerance is not so loose that it hides what the float32 checks catch: a dropped
    forward all-reduce (its layer's output left as a pending sum) under bf16."""
    program = program_from("tiny", "dp+tp", Mesh(dp=2, tp=2), batch=8, precision="bf16")
    bad = program.replace(fault=Fault("drop-all-reduce", "blocks.1.mlp"))
    _, (run,) = run_compare(bad, steps=1, backends=("jax",), bisect=False)
    assert run.grad_diff > 10 * BF16.grad


@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(case=st.data())
def test_bf16_on_random_rule_sets_equals_one_device(case):
    """Random rule sets on random meshes (tests/differential_cases.py: GPTs, the ViT, an MLP
    without constraint points) in bf16, JAX explicit against JAX on one device."""
    from differential_cases import cases, describe, inputs, loss_grads_step, program

    c = case.draw(cases())
    p = program(c).replace(precision="bf16")
    params, batch = inputs(c[0])
    loss0, grads0, _ = get_backend("jax-single").run(p, loss_grads_step, batch, params=params)
    loss, grads, _ = get_backend("jax").run(p, loss_grads_step, batch, params=params)
    assert abs(loss - loss0) <= BF16.loss * abs(loss0), describe(c)
    assert _rel(grads, grads0) <= BF16.grad, describe(c)


@pytest.mark.parametrize("backend,schedule", [("jax", "1f1b"),
                                              pytest.param("jax-mpmd", "gpipe", marks=pytest.mark.exhaustive),
                                              pytest.param("jax-gspmd", "1f1b", marks=pytest.mark.exhaustive),
                                              pytest.param("torch", "zbv", marks=pytest.mark.exhaustive)])
def test_bf16_pipelines_equal_one_device(backend, schedule):
    """Stages send bf16 activations and gradients (the buffers take the compute dtype)."""
    program = program_from("tiny-deep", "pp+dp", Mesh(pp=2, dp=2), batch=8, microbatches=4, schedule=schedule,
                           precision="bf16")
    _, (run,) = run_compare(program, steps=5, backends=(backend,), bisect=False)
    assert run.agree, (run.loss_diff, run.grad_diff, run.param_diff)


# -- every sum is float32 (bf16-sum16: every parameter's) -------------------------------------------------

def _torch_logs(rank, cases):
    from parlay.backends.torch.session import TorchSession

    out = []
    for model, strategy, axes, precision in cases:
        program = program_from(model, strategy, Mesh(axes), batch=8, precision=precision)
        session = TorchSession(program, program.init(0))
        session.step(compare_batches(program, 1, 0)[0])
        out.append([(e.kind, e.dtype, e.backward, e.source, e.nbytes, e.axes) for e in session.log.entries])
    return out if rank == 0 else None


LOGGED = [("tiny", "dp+tp", dict(dp=2, tp=2), "bf16"), ("tiny", "fsdp", dict(dp=4), "bf16"),
          ("tiny", "tp_sp", dict(tp=4), "bf16"), ("tiny", "zero2+ulysses", dict(dp=2, sp=2), "bf16")]
LOGGED16 = [("tiny", "dp+tp", dict(dp=2, tp=2), "bf16-sum16"), ("tiny", "tp_sp", dict(tp=4), "bf16-sum16")]


def test_every_summing_collective_of_a_bf16_torch_step_sends_float32():
    """torch's log of one bf16 step, four ranks, one spawn: every all-reduce and reduce-scatter
    (and every all-gather, whose transpose is a reduce-scatter) sent float32, forward and backward,
    plans and the executor's own sums alike; Ulysses' all-to-alls (which sum nothing) sent bf16,
    so the ops did compute in bf16."""
    logs = spawn(_torch_logs, 4, LOGGED + LOGGED16, timeout_s=600)[0]
    logs, logs16 = logs[:len(LOGGED)], logs[len(LOGGED):]
    for (model, strategy, *_), log in zip(LOGGED, logs):
        sums = [e for e in log if e[0] in SUMS and e[4] > 0]
        assert sums, strategy
        assert {e[1] for e in sums} == {"float32"}, (strategy, sorted({(e[0].value, e[1]) for e in sums}))
        assert any(e[2] for e in sums) and any(not e[2] for e in sums), strategy  # both directions
    ulysses = logs[-1]
    assert {e[1] for e in ulysses if e[0] is Kind.ALL_TO_ALL} == {"bfloat16"}
    assert any(e[3] is Source.OP for e in logs[0] if e[0] in SUMS)  # bucketed data-parallel sums counted too
    # bf16-sum16: the forward's plans (an activation's sums) send bfloat16, the ops' own forward sums
    # (the vocabulary's softmax statistics, the loss) float32; the backward has both, the parameters'
    # gradient sums (dp's buckets; the norms' weights over tp) float32
    for (model, strategy, *_), log, wide in zip(LOGGED16, logs16, (logs[0], logs[2])):
        sums = [e for e in log if e[0] in SUMS and e[4] > 0]
        assert {e[1] for e in sums if not e[2] and e[3] is Source.PLAN} == {"bfloat16"}, strategy
        assert {e[1] for e in sums if not e[2] and e[3] is Source.OP} == {"float32"}, strategy
        assert {e[1] for e in sums if e[2]} == {"bfloat16", "float32"}, strategy
        assert [(e[0], e[2], e[3]) for e in log] == [(e[0], e[2], e[3]) for e in wide], strategy  # same collectives
        assert sum(e[4] for e in sums) < 0.75 * sum(e[4] for e in wide if e[0] in SUMS), strategy
    assert {e[1] for e in logs16[0] if e[0] in SUMS and "dp" in e[5]} == {"float32"}  # dp's buckets, the loss


def _sum_types(stablehlo: str) -> list[str]:
    """The element type each all-reduce and reduce-scatter of a lowered program sums in (its
    reduction region's argument type)."""
    return re.findall(r'stablehlo\.(?:all_reduce|reduce_scatter)".*?\^bb0\(%\w+: tensor<(\w+)>', stablehlo, re.S)


def test_the_lowered_bf16_step_on_jax_sums_in_float32():
    """JAX explicit: the step as lowered, before XLA's passes (the CPU backend would widen a bf16
    sum itself and hide one): every all-reduce and reduce-scatter of the whole step (forward,
    backward, update) sums float32, and the executor's log of its plan steps says float32 too.
    The same check on a step whose widening is removed finds bf16 sums (the check can fail)."""
    import parlay.core.executor as executor

    program = program_from("tiny", "fsdp+tp", Mesh(dp=2, tp=2), batch=8, precision="bf16")
    batch = compare_batches(program, 1, 0)[0]

    def lowered(session, batch):
        text = session._step.lower(session.state, *session._step_args(batch)).as_text()
        return text, [(e.kind, e.dtype) for e in session.log.entries]

    text, log = get_backend("jax").run(program, lowered, batch)
    types = _sum_types(text)
    assert len(types) > 20 and set(types) == {"f32"}, sorted(set(types))
    assert log and {d for k, d in log if k in SUMS} == {"float32"}
    assert "bf16" in text  # and the step does compute in bf16
    wide = executor.ShardedOps._wide
    executor.ShardedOps._wide = lambda self, local: local  # a planted bug: sums in the compute dtype
    try:
        text, _ = get_backend("jax").run(program, lowered, batch)
    finally:
        executor.ShardedOps._wide = wide
    assert "bf16" in _sum_types(text)


def test_the_lowered_bf16_sum16_step_on_jax_sums_activations_in_bf16():
    """bf16-sum16 on JAX explicit (fsdp+tp, dp=2 x tp=2), lowered: every sum over dp (fsdp's
    gradient reduce-scatters, the loss) in float32; over tp, the activations' all-reduces in
    bf16 and the rest (the parameters' gradients, the vocabulary's softmax statistics) float32,
    the same count of sums as bf16's."""
    def lowered(session, batch):
        text = session._step.lower(session.state, *session._step_args(batch)).as_text()
        return text, [(e.kind, e.dtype, e.axes) for e in session.log.entries]

    def sums(text):  # (replica groups, element type) of each all-reduce and reduce-scatter
        return re.findall(r'stablehlo\.(?:all_reduce|reduce_scatter)".*?replica_groups = dense<(.*?)>.*?'
                          r'\^bb0\(%\w+: tensor<(\w+)>', text, re.S)

    dp, tp = "[[0, 2], [1, 3]]", "[[0, 1], [2, 3]]"  # tp is the mesh's minor axis
    found = {}
    for precision in ("bf16", "bf16-sum16"):
        program = program_from("tiny", "fsdp+tp", Mesh(dp=2, tp=2), batch=8, precision=precision)
        found[precision] = get_backend("jax").run(program, lowered, compare_batches(program, 1, 0)[0])
    (wide, _), (narrow, log) = found["bf16"], found["bf16-sum16"]
    assert len(sums(narrow)) == len(sums(wide)) > 20
    assert {t for g, t in sums(narrow) if g == dp} == {"f32"}
    on_tp = [t for g, t in sums(narrow) if g == tp]
    assert on_tp.count("bf16") > on_tp.count("f32") > 0, on_tp
    assert {d for k, d, axes in log if k is Kind.ALL_REDUCE and axes == ("tp",)} == {"bfloat16"}


# -- fp16: dynamic loss scaling survives an overflow -------------------------------------------------

# 2^40 overflows fp16 at once; no growth within the test (the state machine's test checks growth)
PLANTED = Precision("fp16", "float16", loss_scale=2.0 ** 40, growth_interval=1000)


def _overflow_run(session, batches):
    """Every step's loss, the scale after it and whether it was taken; the parameters before and
    after; the update count."""
    before = session.params()
    losses, scales, taken = [], [], []
    for b in batches:
        count = session.count
        losses.append(session.step(b))
        scales.append(session.scaler.scale)
        taken.append(session.count == count + 1)
    return before, losses, scales, taken, session.params(), session.count


def _overflow_torch(rank, program, batches):
    from parlay.backends.torch.session import TorchSession

    out = _overflow_run(TorchSession(program, program.init(0)), batches)
    return out if rank == 0 else None


@pytest.mark.parametrize("backend", ["jax-single", "jax", "torch-single", "torch"])
def test_fp16_skips_an_overflowing_step_and_backs_off(backend):
    """A loss scale of 2^40 turns every gradient into inf in fp16: those steps are skipped (the
    parameters and the update count unchanged), the scale halves each time, and once it fits the
    run takes its steps, as a run that started at that scale takes them."""
    program = program_from("tiny", "fsdp", Mesh(dp=2), batch=8, precision=PLANTED)
    batches = compare_batches(program, 1, 0) * 30

    def run(program, batches):
        if backend == "torch":
            return spawn(_overflow_torch, 2, program, batches, timeout_s=600)[0]
        return get_backend(backend).run(program, _overflow_run, batches)

    before, losses, scales, taken, after, count = run(program, batches)
    k = taken.index(True)  # the overflowing steps before the first one taken
    assert k >= 1 and count == sum(taken)
    assert scales[:k] == [2.0 ** (39 - i) for i in range(k)]  # halved at each
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # and then it trains
    # a run that starts at the scale the backoff reached takes the same steps (scaling by a power
    # of two is exact where nothing overflows): the skipped steps left no trace
    fitted = program.replace(precision=dataclasses.replace(PLANTED, loss_scale=2.0 ** (40 - k)))
    _, losses2, _, taken2, after2, _ = run(fitted, batches[k:])
    assert taken2 == taken[k:]
    np.testing.assert_allclose(losses[k:], losses2, rtol=1e-6)
    for name in after:
        np.testing.assert_allclose(after[name], after2[name], rtol=0, atol=1e-6 * np.abs(after2[name]).max())


def test_the_loss_scale_state_machine():
    s = LossScale(8.0, growth_interval=2)
    assert s.update(True) and s.scale == 8.0
    assert s.update(True) and s.scale == 16.0  # two finite steps: doubled
    assert not s.update(False) and s.scale == 8.0 and s.skipped == 1
    assert s.good == 0


# -- refusals, and the checkpoint says the policy -----------------------------------------------------

def test_what_mixed_precision_refuses_is_one_clear_error():
    program = program_from("tiny", "dp", Mesh(dp=2), batch=8, precision="bf16")
    with pytest.raises(ValueError, match="numpy simulator computes in float32 only"):
        get_backend("numpy").run(program, lambda s: None)
    with pytest.raises(ProgramError, match="use --precision bf16"):
        program_from("tiny-deep", "pp+dp", Mesh(pp=2, dp=2), batch=8, microbatches=2, precision="fp16")
    with pytest.raises(ValueError, match="choose from fp32, bf16, bf16-sum16, fp16"):
        parse_precision("fp8")


def test_a_bf16_checkpoint_keeps_float32_masters_and_says_the_policy(tmp_path):
    """Trained in bf16 under fsdp and saved; the manifest names the policy, every tensor is
    float32 (the masters and AdamW's moments); it resumes in fp32 under dp+tp."""
    import json

    from parlay.checkpoint import Checkpoint, latest
    from parlay.training import TrainSpec, run_train

    spec = TrainSpec(backend="jax", strategy="fsdp", mesh=(("dp", 4),), model="tiny", steps=2, batch=8,
                     precision="bf16", eval_batches=0, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    run_train(spec)
    ckpt = Checkpoint(latest(tmp_path))
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    assert manifest["precision"]["policy"] == "bf16" and manifest["precision"]["masters"] == "float32"
    from safetensors.numpy import load_file

    stored = {k: v.dtype for f in ckpt.path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert len(stored) >= len(manifest["tensors"]) and set(stored.values()) == {np.dtype(np.float32)}
    resumed = run_train(dataclasses.replace(spec, strategy="dp+tp", mesh=(("dp", 2), ("tp", 2)), precision="fp32",
                                            steps=3, checkpoint_dir=None, checkpoint_every=0), resume=ckpt)
    assert len(resumed.losses) == 3 and np.isfinite(resumed.losses).all()
