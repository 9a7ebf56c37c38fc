"""The fused AdamW step (interpreter) against torch.optim.AdamW, over several steps and tensors.

Under the interpreter a program updates chunks of 256 elements in blocks of 64: the shapes below
give several chunks per tensor, masked tails, a one-element tensor and an empty one, all in one
launch per dtype combination.

Tolerance: fp32 parameters and moments within 1e-6 relative to each tensor's largest magnitude
after five steps (the same fp32 formula; measured: at most 2e-7). bf16 tensors (torch keeps
AdamW's state in the parameter's dtype) are checked for one step against torch's fp32 step
rounded once, to 1e-2: one bf16 rounding of the largest value. (Over several bf16 steps torch,
which rounds every intermediate, and the kernel, which rounds once, drift apart by design.)
"""

import pytest
import torch

from parlay.triton_kernels import adamw_step

from kernel_checks import rel_err

SHAPES = [(1000,), (3, 37), (1,), (17, 5, 3), (0, 4)]
HP = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _step_all(params, grads, exp_avgs, exp_avg_sqs, step):
    adamw_step(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=HP["lr"], beta1=HP["betas"][0],
               beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])


def test_five_steps_equal_torch_adamw():
    params = [torch.randn(s) for s in SHAPES]
    peer = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(peer, foreach=False, **HP)
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = [torch.randn(s) for s in SHAPES]
        for p, g in zip(peer, grads):
            p.grad = g.clone()
        opt.step()
        _step_all(params, grads, exp_avgs, exp_avg_sqs, step)
    for i, p in enumerate(peer):
        if p.numel() == 0:
            continue
        state = opt.state[p]
        errors = {"param": rel_err(params[i], p), "exp_avg": rel_err(exp_avgs[i], state["exp_avg"]),
                  "exp_avg_sq": rel_err(exp_avg_sqs[i], state["exp_avg_sq"])}
        assert max(errors.values()) < 1e-6, (SHAPES[i], errors)


def test_bf16_and_fp32_tensors_in_one_call_take_the_fp32_step_rounded_once():
    # The kernel loads each tensor in its dtype, computes in fp32 and stores once; the reference is
    # torch's AdamW on fp32 copies, rounded. One launch per dtype combination.
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    shapes = [(300,), (7, 9), (3, 37), (1,)]
    params = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes)]
    exp_avgs = [(0.1 * torch.randn(s)).to(d) for s, d in zip(shapes, dtypes)]
    exp_avg_sqs = [(0.01 * torch.rand(s)).to(d) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes)]
    peer = [p.float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(peer, foreach=False, **HP)
    for p, g, m, v in zip(peer, grads, exp_avgs, exp_avg_sqs):
        p.grad = g.float()
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    opt.step()  # the fourth step
    _step_all(params, grads, exp_avgs, exp_avg_sqs, 4)
    for i, p in enumerate(peer):
        # bf16: one rounding of the largest value is 2^-7 = 7.8e-3 relative (the interpreter
        # truncates; a GPU rounds to nearest, half that)
        tol = 1e-2 if dtypes[i] == torch.bfloat16 else 1e-6
        state = opt.state[p]
        errors = {"param": rel_err(params[i], p), "exp_avg": rel_err(exp_avgs[i], state["exp_avg"]),
                  "exp_avg_sq": rel_err(exp_avg_sqs[i], state["exp_avg_sq"])}
        assert params[i].dtype == dtypes[i] and max(errors.values()) < tol, (dtypes[i], errors)


def test_the_update_bumps_autograd_version_counters():
    p, g, m, v = torch.randn(10), torch.randn(10), torch.randn(10), torch.rand(10)
    before = p._version
    adamw_step([p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    assert p._version > before


def test_bad_inputs_say_what_was_given_and_the_rule():
    t = [torch.zeros(4)]
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"adamw_step: the lists have lengths \{'params': 1, 'grads': 2, "):
        adamw_step(t, t * 2, t, t, **kw)
    with pytest.raises(ValueError, match=r"adamw_step: parameter 0: shapes .*'grads': \(5,\).* differ"):
        adamw_step(t, [torch.zeros(5)], t, t, **kw)
    with pytest.raises(ValueError, match=r"adamw_step: step=0; it must be the 1-based count of this update"):
        adamw_step(t, t, t, t, **{**kw, "step": 0})
    with pytest.raises(ValueError, match=r"adamw_step: betas \(0.9, 1.0\); each must be in \[0, 1\)"):
        adamw_step(t, t, t, t, **{**kw, "beta2": 1.0})
    with pytest.raises(ValueError, match=r"adamw_step: exp_avgs\[0\] \(shape \(4, 2\)\) is not contiguous"):
        adamw_step([torch.zeros(4, 2)], [torch.zeros(4, 2)], [torch.zeros(2, 4).t()], [torch.zeros(4, 2)], **kw)
    with pytest.raises(ValueError, match=r"adamw_step: grads\[0\] has dtype torch.int64"):
        adamw_step(t, [torch.zeros(4, dtype=torch.int64)], t, t, **kw)
