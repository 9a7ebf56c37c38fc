"""RMSNorm and LayerNorm kernels (interpreter) against float64 torch, forward and every gradient.

Shapes are odd on purpose: a hidden size that is not a power of two (masked columns), and more
rows than one tile holds, not a multiple of it (masked rows; several backward programs, each
looping over row blocks, so the weight gradient's partial sums are really summed).

Tolerances, relative to the reference's largest magnitude: fp32 1e-5 (measured: at most 3e-7).
bf16 2e-2: inputs are exact bf16 values, sums are fp32, but the output and dx are rounded to bf16
(relative step 2^-8 = 3.9e-3; the interpreter truncates where a GPU rounds to nearest) and dw/db
are sums over hundreds of rows (measured over seeds: at most 8e-3).
"""

import pytest
import torch

from parlay.triton_kernels import layer_norm, rms_norm

from kernel_checks import leaves, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHAPES = [(3, 101, 24), (257, 7), (5, 70)]


def ref_rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_ln(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * w + b


def _check(got_out, ref_out, got_inputs, ref_inputs, dtype):
    g = torch.randn(ref_out.shape, dtype=torch.float64)
    got_out.backward(g.to(got_out.dtype))
    ref_out.backward(g)
    assert got_out.dtype == dtype and got_out.shape == ref_out.shape
    errors = {"out": rel_err(got_out, ref_out)}
    errors |= {f"grad {i}": rel_err(a.grad, b.grad) for i, (a, b) in enumerate(zip(got_inputs, ref_inputs))}
    assert max(errors.values()) < TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_and_its_gradients_equal_float64(shape, dtype):
    n = shape[-1]
    x, w, xd, wd = leaves(torch.randn(shape) * 3 + 1, 1 + 0.5 * torch.randn(n), dtype=dtype)
    _check(rms_norm(x, w, 1e-5), ref_rms(xd, wd, 1e-5), [x, w], [xd, wd], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_and_its_gradients_equal_float64(shape, dtype):
    n = shape[-1]
    x, w, b, xd, wd, bd = leaves(torch.randn(shape) * 3 + 1, 1 + 0.5 * torch.randn(n), torch.randn(n), dtype=dtype)
    _check(layer_norm(x, w, b, 1e-5), ref_ln(xd, wd, bd, 1e-5), [x, w, b], [xd, wd, bd], dtype)


def test_a_non_contiguous_input_and_output_gradient():
    base = torch.randn(24, 40)
    x = base.t().detach().requires_grad_()  # (40, 24), rows strided
    w = torch.randn(24, requires_grad=True)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y, yr = rms_norm(x, w, 1e-6), ref_rms(xd, wd, 1e-6)
    g = torch.randn(24, 40).t()  # a strided output gradient
    y.backward(g)
    yr.backward(g.double())
    assert max(rel_err(y, yr), rel_err(x.grad, xd.grad), rel_err(w.grad, wd.grad)) < 1e-5


def test_bad_inputs_say_what_was_given_and_the_rule():
    x = torch.randn(4, 24)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \(23,\) but x has shape \(4, 24\); weight must "
                                         r"have shape \(24,\)"):
        rms_norm(x, torch.ones(23), 1e-5)
    with pytest.raises(ValueError, match=r"layer_norm: bias has shape \(2, 12\)"):
        layer_norm(x, torch.ones(24), torch.ones(2, 12), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: x has dtype torch.float64; the kernels take float32, bfloat16"):
        rms_norm(x.double(), torch.ones(24, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: x's last dim is 20000 \(torch.float32\), over the 65536 bytes"):
        rms_norm(torch.randn(2, 20000), torch.ones(20000), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: x has shape \(\); it needs a non-empty last dim"):
        rms_norm(torch.tensor(1.0), torch.ones(1), 1e-5)
