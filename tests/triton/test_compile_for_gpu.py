"""Every kernel compiles for an H100/H200 (sm_90) with the tile sizes the GPU path picks.

No GPU is needed: Triton compiles to a cubin with the ptxas its wheel ships. This catches what the
interpreter cannot: tl.dot's tile and dtype rules, layouts, and shared memory over the 227 KiB an
sm_90 block may use. It does not run the kernels; benchmarks/triton_gpu.py does, on a GPU.
"""

import inspect

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from parlay.triton_kernels import _adamw, _attention, _cross_entropy, _launch, _norms

SM90_SHARED = 232448  # bytes of shared memory one block may use on sm_90
FLOATS = {"eps", "qk_scale", "sm_scale", "decay", "lerp_w", "beta2", "one_minus_beta2", "step_size", "bc2_sqrt"}
TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture(autouse=True)
def compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET")  # the GPU tile sizes, and triton.jit compiles
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, leave nothing behind
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    assert not _launch.is_interpreting()


def _compile(kern, pointers: dict, constexprs: dict, warps: int, stages: int = 3):
    """Compile ``kern`` for sm_90: pointers typed by ``pointers`` (``"*"`` for the rest), float
    scalars fp32, other scalars i32."""
    sig = {}
    for name in inspect.signature(kern.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, pointers["*"])
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(kern.jitted(), sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert "cubin" in compiled.asm
    assert compiled.metadata.shared <= SM90_SHARED, (kern.__name__, constexprs, compiled.metadata.shared)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_attention_kernels_compile_for_sm90(dtype, head_dim):
    cfg = _attention._config(head_dim, dtype)
    pointers = {"*": TY[dtype], "lse_ptr": "fp32", "delta_ptr": "fp32"}
    meta = dict(CAUSAL=True, DOT=_launch.dot_dtype(dtype), PREC=_launch.dot_precision(dtype), BLOCK_D=cfg["block_d"])
    _compile(_attention._attn_fwd, pointers, dict(meta, BLOCK_M=cfg["fwd"][0], BLOCK_N=cfg["fwd"][1]), cfg["warps"],
             cfg["stages"])
    _compile(_attention._attn_bwd_delta, pointers, dict(BLOCK_M=cfg["bwd"][0], BLOCK_D=cfg["block_d"]), cfg["warps"])
    for kern in (_attention._attn_bwd_dkdv, _attention._attn_bwd_dq):
        _compile(kern, pointers, dict(meta, BLOCK_M=cfg["bwd"][0], BLOCK_N=cfg["bwd"][1]), cfg["warps"], cfg["stages"])


def test_norm_cross_entropy_and_adamw_kernels_compile_for_sm90():
    block_m, block_n, warps = _norms._blocks(4096)
    for rms in (True, False):
        meta = dict(IS_RMS=rms, HAS_BIAS=not rms, BLOCK_M=block_m, BLOCK_N=block_n)
        _compile(_norms._norm_fwd, {"*": "bf16", "mean_ptr": "fp32", "rstd_ptr": "fp32"}, meta, warps)
        _compile(_norms._norm_bwd, {"*": "bf16", "mean_ptr": "fp32", "rstd_ptr": "fp32", "dw_ptr": "fp32",
                                    "db_ptr": "fp32"}, meta, warps)
    block_m, block_v, warps = _cross_entropy._blocks(50304)
    meta = dict(BLOCK_M=block_m, BLOCK_V=block_v)
    _compile(_cross_entropy._ce_stats, {"*": "fp32", "x_ptr": "bf16", "t_ptr": "i64"}, meta, warps)
    _compile(_cross_entropy._ce_grad, {"*": "fp32", "x_ptr": "bf16", "dx_ptr": "bf16", "t_ptr": "i64"}, meta, warps)
    _compile(_adamw._adamw, {"*": "i64"}, dict(P_DT=tl.bfloat16, G_DT=tl.bfloat16, M_DT=tl.float32, V_DT=tl.float32,
                                               CHUNK=65536, BLOCK=1024), 4)
