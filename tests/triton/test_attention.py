"""The FlashAttention-2 kernels (interpreter) against float64 softmax attention: output, dq, dk, dv.

Tiles are 16 x 16 under the interpreter; sequence lengths 37 and 50 are not multiples of 16 (a
masked tail of queries and keys), head dims 24 and 40 are not powers of two (padded to 32 and 64
in registers, masked), and GQA groups of 2 and 3 query heads per kv head are summed in dK/dV.

Tolerances, relative to the reference's largest magnitude: fp32 1e-5 (measured: at most 5e-7).
bf16 2.5e-2 and fp16 3e-3: the inputs are exact in both, sums are fp32, but as in FlashAttention
the probabilities and dS are rounded to the input dtype before their matmuls, and the outputs too
(bf16 step 2^-8, fp16 2^-11; the interpreter truncates to bf16 where a GPU rounds to nearest;
measured over seeds: bf16 at most 8e-3, fp16 at most 7e-4).
"""

import math

import pytest
import torch

from parlay.triton_kernels import attention

from kernel_checks import leaves, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2, torch.float16: 3e-3}


def reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _run(b, h, hkv, sq, sk, d, dtype, causal, **blocks):
    q, k, v, qd, kd, vd = leaves(torch.randn(b, h, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d),
                                 dtype=dtype)
    out, ref = attention(q, k, v, causal=causal, **blocks), reference(qd, kd, vd, causal)
    g = torch.randn(ref.shape, dtype=torch.float64)
    out.backward(g.to(dtype))
    ref.backward(g)
    assert out.dtype == dtype and out.shape == ref.shape
    return {"out": rel_err(out, ref), "dq": rel_err(q.grad, qd.grad), "dk": rel_err(k.grad, kd.grad),
            "dv": rel_err(v.grad, vd.grad)}


CASES = [  # (batch, heads, kv heads, seq, head_dim)
    pytest.param((2, 4, 4, 37, 24), id="MHA-seq37-d24"),
    pytest.param((1, 6, 2, 50, 40), id="GQA3-seq50-d40"),
    pytest.param((2, 4, 2, 16, 16), id="GQA2-seq16-d16"),
]


@pytest.mark.parametrize("shape", CASES)
def test_causal_attention_fp32(shape):
    b, h, hkv, s, d = shape
    errors = _run(b, h, hkv, s, s, d, torch.float32, True)
    assert max(errors.values()) < TOL[torch.float32], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_gqa_attention_in_half_precision(dtype):
    errors = _run(2, 4, 2, 37, 37, 24, dtype, True)
    assert max(errors.values()) < TOL[dtype], errors


def test_full_attention_with_fewer_keys_than_queries():
    errors = _run(1, 4, 2, 45, 21, 8, torch.float32, False)
    assert max(errors.values()) < TOL[torch.float32], errors


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16)])
def test_rectangular_tiles_give_the_same_result(block_m, block_n):
    # The causal loop bounds of each kernel where query and key tiles differ (as on a GPU: 128 x 64)
    errors = _run(1, 2, 1, 70, 70, 24, torch.float32, True, block_m=block_m, block_n=block_n)
    assert max(errors.values()) < TOL[torch.float32], errors


def test_a_strided_layout_as_the_torch_backend_passes_it():
    # TorchOps holds (B, S, H, D) and passes transposed views: no copies, arbitrary strides.
    base = [torch.randn(2, 37, n, 24) for n in (4, 2, 2)]
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in base)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, ref = attention(q, k, v), reference(qd, kd, vd, True)
    g = torch.randn(ref.shape, dtype=torch.float64)
    out.backward(g.float())
    ref.backward(g)
    assert max(rel_err(a, b) for a, b in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad))) < 1e-5


def test_bad_inputs_say_what_was_given_and_the_rule():
    q = torch.randn(1, 6, 8, 16)
    with pytest.raises(ValueError, match=r"attention: got q \(1, 6, 8, 16\), k \(1, 4, 8, 16\), v \(1, 4, 8, 16\); "
                                         r"k and v's 4 heads must divide q's 6"):
        attention(q, torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16))
    with pytest.raises(ValueError, match=r"q, k and v must be 4-d: \(batch, heads, seq, head_dim\)"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"k and v must have one shape, with q's batch and head_dim"):
        attention(q, torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"q, k, v have dtypes torch.float32, torch.float16, torch.float32"):
        attention(q, q.half(), q)
    with pytest.raises(ValueError, match=r"head_dim 300 .* is over the 256 the kernels tile"):
        big = torch.randn(1, 1, 4, 300)
        attention(big, big, big)
    with pytest.raises(ValueError, match=r"block_m=24; a tile size must be a power of two, at least 16"):
        attention(q, q, q, block_m=24)
    with pytest.raises(ValueError, match=r"block_n=8; a tile size must be a power of two, at least 16"):
        attention(q, q, q, block_n=8)
