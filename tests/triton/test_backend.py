"""The torch backend with the Triton kernels forced (interpreter) equals its plain torch ops.

Single process: TorchLocal on the tiny GPTs (RMSNorm, GQA attention, SwiGLU; and LayerNorm, MHA,
GELU). On two gloo ranks: the sharded executor under Megatron tp (the vocab-parallel loss over tp, fused
norms on whole rows, GQA heads split over tp), dp (norm weight gradients summed over dp), and
tp2d with embed split over an axis (the norms' sharded-row path stays on torch collectives). Each
run counts the kernels it launched, so a silent fallback to torch fails the test, and the
collectives it issued, which the kernels must not change.

Parameters are the model's initial values plus noise (norm scales and biases off 1 and 0).
Tolerances (fp32): loss 1e-5 relative, each gradient 1e-5 of its largest element: the same sums
in another order (measured: at most 1e-6).
"""

import numpy as np
import pytest
import torch

from parlay.backends.torch.launch import spawn
from parlay.backends.torch.ops import TorchLocal
from parlay.triton_kernels import use_kernels

from kernel_workers import count_launches, gpt_inputs, sharded_loss_and_grads, single_loss_and_grads


def _close(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        err = np.abs(grads[k] - ref_grads[k]).max() / np.abs(ref_grads[k]).max()
        assert err <= 1e-5, (k, err)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-gpt2"])
def test_tiny_gpt_with_the_kernels_forced_equals_the_torch_ops(preset):
    model, params, batch = gpt_inputs(preset)
    with use_kernels("torch"), count_launches() as none:
        ref_loss, ref_grads = single_loss_and_grads(model, params, batch)
    with use_kernels("triton"), count_launches() as launches:
        loss, grads = single_loss_and_grads(model, params, batch)
    assert not none
    layers = model.config.layers  # per layer two norms and one attention; then the final norm and the loss
    assert launches["_norm_fwd"] == launches["_norm_bwd"] == 2 * layers + 1, launches
    assert launches["_attn_fwd"] == launches["_attn_bwd_dkdv"] == launches["_attn_bwd_dq"] == layers, launches
    assert launches["_ce_stats"] == launches["_ce_grad"] == 1, launches
    _close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_run_uses_the_kernels_and_is_as_close_to_float32_as_the_torch_ops(preset, precision):
    """Under bf16/fp16 the norms and attention get 16-bit operands (the loss float32 logits): the
    kernels take them, as FlashAttention does. Both paths round differently, so each is held to
    the float32 run: the loss within one unit roundoff u (measured at most 0.56u: the interpreter
    truncates to bf16 where a GPU rounds to nearest, a bias that does not average out), each
    gradient's error (of its largest element) at most 1.5x the torch ops' own (measured 1.26x).
    A wrong kernel misses both by orders of magnitude."""
    model, params, batch = gpt_inputs(preset)
    with use_kernels("torch"):
        ref_loss, ref_grads = single_loss_and_grads(model, params, batch)
        t_loss, t_grads = single_loss_and_grads(model, params, batch, precision)
    with use_kernels("triton"), count_launches() as launches:
        loss, grads = single_loss_and_grads(model, params, batch, precision)
    layers = model.config.layers
    assert launches["_norm_fwd"] == launches["_norm_bwd"] == 2 * layers + 1, launches
    assert launches["_attn_fwd"] == launches["_attn_bwd_dq"] == layers, launches
    assert launches["_ce_stats"] == 1, launches
    u = 2.0 ** -8 if precision == "bf16" else 2.0 ** -11
    assert abs(loss - ref_loss) <= u * abs(ref_loss), (loss, ref_loss)
    err = lambda g: max(np.abs(g[k] - ref_grads[k]).max() / np.abs(ref_grads[k]).max() for k in ref_grads)
    assert err(grads) <= 1.5 * err(t_grads), (err(grads), err(t_grads))


def test_the_explicit_choice_on_the_ops_wins_over_the_context():
    x, w = torch.randn(3, 8), torch.ones(8)
    with use_kernels("triton"), count_launches() as launches:
        TorchLocal(kernels="torch").rms_norm(x, w, 1e-5)
    assert not launches
    with use_kernels("torch"), count_launches() as launches:
        TorchLocal(kernels="triton").rms_norm(x, w, 1e-5)
    assert launches["_norm_fwd"] == 1


CASES = [("tp", [("tp", 2)]), ("dp", [("dp", 2)]), ("tp2d", [("row", 2), ("col", 1)])]


def test_sharded_runs_with_the_kernels_forced_equal_the_torch_ops_and_one_process():
    model, params, batch = gpt_inputs("tiny-gqa")
    with use_kernels("torch"):
        ref_loss, ref_grads = single_loss_and_grads(model, params, batch)
    ranks = spawn(sharded_loss_and_grads, 2, "tiny-gqa", CASES, timeout_s=300)
    layers = model.config.layers
    for strategy, _ in CASES:
        loss_t, grads_t, fwd_t, bwd_t, launches_t = ranks[0][strategy, "torch"]
        loss_k, grads_k, fwd_k, bwd_k, launches_k = ranks[0][strategy, "triton"]
        assert not launches_t, (strategy, launches_t)
        # tp2d splits embed: the norms keep their sharded-row torch path, attention and loss are kernels
        norms = 0 if strategy == "tp2d" else 2 * layers + 1
        assert launches_k.get("_norm_fwd", 0) == launches_k.get("_norm_bwd", 0) == norms, (strategy, launches_k)
        assert launches_k["_attn_fwd"] == launches_k["_attn_bwd_dq"] == layers, (strategy, launches_k)
        assert launches_k["_ce_stats"] == launches_k["_ce_grad"] == 1, (strategy, launches_k)
        assert (fwd_k, bwd_k) == (fwd_t, bwd_t), strategy  # the same collectives, forward and backward
        for rank in ranks:
            assert rank[strategy, "triton"][0] == pytest.approx(loss_k, rel=1e-6)  # one loss on every rank
        _close(loss_k, grads_k, loss_t, grads_t)
        _close(loss_k, grads_k, ref_loss, ref_grads)


def test_the_trainers_adamw_step_runs_the_fused_kernel_on_the_optimizers_state():
    """The trainers' update (``_adamw_step``) with the kernels forced: the same gradients, the
    warmup-cosine schedule, the optimizer's own state (what checkpoints save): equal to
    torch.optim.AdamW to fp32 rounding over 4 steps."""
    from parlay.backends.torch.session import _adamw, _adamw_step
    from parlay.core.optim import OptimizerConfig

    cfg = OptimizerConfig(lr=1e-2, warmup=2, decay_steps=4)
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (129,), (3, 4, 7)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    runs = {}
    for kernels in ("torch", "triton"):
        params = [p.clone().requires_grad_() for p in start]
        opt, updates = _adamw(params, cfg), 0
        with use_kernels(kernels), count_launches() as launches:
            for step_grads in grads:
                for p, gr in zip(params, step_grads):
                    p.grad = gr.clone()
                updates = _adamw_step(opt, cfg, updates)
        runs[kernels] = (params, opt, launches)
    assert runs["triton"][2]["_adamw"] == 4 and not runs["torch"][2]
    # Moments: the kernel's fused fp32 arithmetic rounds apart from torch's separate in-place ops
    # (measured: 2e-6 relative, on one element), hence 1e-5 for them.
    for p, q in zip(runs["torch"][0], runs["triton"][0]):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(runs["triton"][1].state[q][key], runs["torch"][1].state[p][key], rtol=1e-5, atol=1e-8)
        assert float(runs["triton"][1].state[q]["step"]) == float(runs["torch"][1].state[p]["step"]) == 4


def test_training_steps_with_every_kernel_forced_follow_torch():
    """The single-process session, 3 steps, kernels forced for the norms, attention, the loss and AdamW.
    Per tensor as parlay compare measures it: the parameters' difference over how far torch moved
    them (elements near Adam's eps amplify fp32 gradient differences; 2e-3 as compare's)."""
    from parlay import Mesh
    from parlay.backends.torch.session import TorchSingleSession
    from parlay.core.program import make_program

    model, params, batch = gpt_inputs("tiny-gqa")
    runs = {}
    for kernels in ("torch", "triton"):
        session = TorchSingleSession(make_program(model, "dp", Mesh(dp=1), batch=2), params)
        with use_kernels(kernels):
            losses = [session.step(batch) for _ in range(3)]
        runs[kernels] = (losses, session.params())
    np.testing.assert_allclose(runs["triton"][0], runs["torch"][0], rtol=1e-5)
    for k, p0 in params.items():
        moved = np.linalg.norm(runs["torch"][1][k] - p0)
        assert np.linalg.norm(runs["triton"][1][k] - runs["torch"][1][k]) <= 2e-3 * moved, k
