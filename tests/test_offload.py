"""Optimizer offload (``--offload``): AdamW's states live in host memory between steps. JAX: they
come to the device for the update inside the one jitted step (the ``pinned_host`` memory kind,
which its CPU backend has too). torch: host masters and moments, stepped by the fused CPU AdamW. The offloaded run is the same computation: held to 1e-6 over 5 steps,
measured bitwise equal on JAX, within 2 ulp on torch (its fused CPU AdamW rounds in another order). What the device holds of the model state falls from 16 bytes a parameter
(float32 parameter, gradient, two moments) to 8, and under zero1/zero2/fsdp the shards' share.
"""

import math

import jax
import numpy as np
import pytest

from parlay.compare import compare_batches, compare_steps
from parlay.core import Mesh, get_backend
from parlay.core.memory import memory_report
from parlay.core.program import program_from


def _run(session, batches):
    out = compare_steps(session, batches)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(session.state["opt"])}
    params = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(session.state["params"])}
    return out, kinds, params


@pytest.mark.parametrize("backend,strategy,axes", [
    ("jax", "zero1", dict(dp=4)), ("jax", "zero2+tp", dict(dp=2, tp=2)), ("jax-gspmd", "fsdp", dict(dp=4)),
    ("jax-single", "dp", dict(dp=1)), pytest.param("jax", "fsdp", dict(dp=4), marks=pytest.mark.exhaustive),
    pytest.param("jax-gspmd", "zero2", dict(dp=4), marks=pytest.mark.exhaustive)])
def test_offloaded_states_give_the_same_steps(backend, strategy, axes):
    runs = []
    for offload in (False, True):
        program = program_from("tiny", strategy, Mesh(axes), batch=8, offload=offload)
        runs.append(get_backend(backend).run(program, _run, compare_batches(program, 5, 0), params=program.init(0)))
    ((losses0, grads0, params0), kinds0, _), ((losses, grads, params), kinds, held) = runs
    assert kinds0 == {"device"} and kinds == {"pinned_host"} and held == {"device"}
    np.testing.assert_allclose(losses, losses0, rtol=1e-6)
    for k in params0:
        np.testing.assert_allclose(params[k], params0[k], rtol=1e-6, atol=1e-6 * np.abs(params0[k]).max(), err_msg=k)


def test_fp16_loss_scaling_with_offload_skips_on_the_host_states():
    """A skipped step keeps the host states as they were (the where() of the skip runs on the
    states brought in, and they go back out)."""
    from parlay.core.precision import Precision

    planted = Precision("fp16", "float16", loss_scale=2.0 ** 40, growth_interval=1000)
    program = program_from("tiny", "zero1", Mesh(dp=2), batch=8, precision=planted, offload=True)
    batch = compare_batches(program, 1, 0)[0]

    def run(session):
        session.step(batch)  # 2^40: overflows, skipped
        mu = [np.asarray(leaf) for leaf in jax.tree.leaves(session.state["opt"]) if leaf.ndim]
        return session.count, session.scaler.skipped, mu

    count, skipped, mu = get_backend("jax").run(program, run)
    assert (count, skipped) == (0, 1) and all(not m.any() for m in mu)


def test_the_device_holds_8_bytes_a_parameter_and_the_shards_share():
    for strategy, axes, device_bytes in [("dp", dict(dp=1), 8), ("zero1", dict(dp=4), 8), ("fsdp", dict(dp=4), 2)]:
        plain = memory_report(program_from("tiny", strategy, Mesh(axes), batch=8), "jax")
        off = memory_report(program_from("tiny", strategy, Mesh(axes), batch=8, offload=True), "jax")
        program = program_from("tiny", strategy, Mesh(axes), batch=8)
        n = sum(math.prod(s) for s in program.shapes.values())
        assert off.optimizer == 0 and off.host == plain.optimizer
        # within the replicated parameters' share (norm scales and biases stay whole under fsdp)
        assert off.state / n == pytest.approx(device_bytes, rel=0.01), strategy
        assert plain.state / n > off.state / n


def test_a_checkpoint_of_an_offloaded_run_resumes_without_offload_and_back(tmp_path):
    """fsdp with offload, saved at step 2; resumed as zero1 on the device; and as offloaded
    dp+tp: both take the uninterrupted run's steps 3 and 4."""
    import dataclasses

    from parlay.checkpoint import Checkpoint, latest
    from parlay.training import TrainSpec, run_train

    spec = TrainSpec(backend="jax", strategy="fsdp", mesh=(("dp", 4),), model="tiny", steps=4, batch=8,
                     offload=True, eval_batches=0)
    whole = run_train(spec).losses
    run_train(dataclasses.replace(spec, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    ckpt = Checkpoint(latest(tmp_path))
    for strategy, mesh, offload in [("zero1", (("dp", 4),), False), ("dp+tp", (("dp", 2), ("tp", 2)), True)]:
        resumed = run_train(dataclasses.replace(spec, strategy=strategy, mesh=mesh, offload=offload), resume=ckpt)
        np.testing.assert_allclose(resumed.losses, whole, rtol=1e-5)


def _torch_cases(rank, cases):
    """Each case plain and offloaded on this spawn's ranks: losses, parameters, where the masters live."""
    from parlay.backends.torch.session import TorchSession

    out = []
    for strategy, axes in cases:
        runs = []
        for offload in (False, True):
            program = program_from("tiny", strategy, Mesh(axes), batch=8, offload=offload)
            session = TorchSession(program, program.init(0))
            losses = [session.step(b) for b in compare_batches(program, 5, 0)]
            masters = {m.device.type for m in session.master.values()}
            fused = {bool(g.get("fused")) for g in session.opt.param_groups}
            aliased = any(session.master[k] is session.local.get(k) for k in session.master)
            runs.append((losses, session.params(), masters, fused, aliased))
        out.append(runs)
    return out if rank == 0 else None


TORCH_CASES = [("zero1", dict(dp=4)), ("fsdp", dict(dp=4)), ("dp+tp", dict(dp=2, tp=2))]


def test_torch_offload_steps_host_masters_with_the_fused_cpu_adamw():
    """Four gloo ranks, one spawn: the offloaded run (host masters and moments, torch's fused CPU
    AdamW, gradients copied to the host and parameters back) takes the plain run's steps."""
    from parlay.backends.torch.launch import spawn

    results = spawn(_torch_cases, 4, TORCH_CASES, timeout_s=600)[0]
    for (strategy, _), ((losses0, params0, _, _, _), (losses, params, masters, fused, aliased)) in zip(TORCH_CASES,
                                                                                                    results):
        assert fused == {True} and not aliased, strategy  # separate host copies, stepped by the fused kernel
        np.testing.assert_allclose(losses, losses0, rtol=1e-6, err_msg=strategy)
        for k in params0:  # the fused kernel rounds differently: measured at most 2 ulp after 5 steps
            np.testing.assert_allclose(params[k], params0[k], rtol=1e-6, atol=1e-6 * np.abs(params0[k]).max(),
                                       err_msg=f"{strategy}: {k}")


def test_what_offload_refuses_is_one_clear_error():
    piped = program_from("tiny-deep", "pp+dp", Mesh(pp=2, dp=2), batch=8, microbatches=2, offload=True)
    with pytest.raises(ValueError, match="without a pipeline so far"):
        get_backend("jax").run(piped, lambda s: None)
    with pytest.raises(ValueError, match="without a pipeline so far"):
        get_backend("torch").run(piped, lambda s: None)
