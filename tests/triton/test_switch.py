"""The switch between the Triton kernels and plain torch, and importing without Triton."""

import os
import subprocess
import sys

import pytest
import torch

from parlay.triton_kernels import Kernels, current_kernels, rms_norm, set_kernels, should_use_triton, use_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_environment_sets_the_default_and_the_context_overrides_it(monkeypatch):
    assert current_kernels() is Kernels.AUTO
    monkeypatch.setenv("PARLAY_KERNELS", "Torch")
    assert current_kernels() is Kernels.TORCH
    with use_kernels("triton") as chosen:
        assert chosen is Kernels.TRITON and current_kernels() is Kernels.TRITON
        with use_kernels(Kernels.AUTO):
            assert current_kernels() is Kernels.AUTO
        assert current_kernels() is Kernels.TRITON
    assert current_kernels() is Kernels.TORCH
    set_kernels("triton")
    try:
        assert current_kernels() is Kernels.TRITON
    finally:
        set_kernels(None)
    assert current_kernels() is Kernels.TORCH


def test_auto_keeps_cpu_tensors_on_torch_and_a_forced_choice_is_obeyed():
    x = torch.randn(2, 4)
    assert not should_use_triton("auto", x)  # CPU: the interpreter is for tests, never chosen by itself
    assert should_use_triton("triton", x)
    assert not should_use_triton("torch", x)
    with use_kernels("triton"):
        assert should_use_triton(None, x)


def test_bad_choices_name_the_choices(monkeypatch):
    with pytest.raises(ValueError,
                       match=r"kernels='cuda' is not a kernel choice; use one of 'auto', 'triton', 'torch'"):
        use_kernels("cuda").__enter__()
    monkeypatch.setenv("PARLAY_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"PARLAY_KERNELS='fast' is not a kernel choice"):
        current_kernels()


def test_a_kernel_on_cpu_tensors_without_the_interpreter_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"rms_norm: the Triton kernels run on CUDA tensors; got cpu\. On the CPU set "
                                         r"TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5)


def test_without_triton_the_package_imports_and_the_backend_runs_on_torch():
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
import parlay.triton_kernels as tk
from parlay.backends.torch.ops import TorchLocal
x, w = torch.randn(2, 4), torch.ones(4)
assert tk.triton_error() is not None and "triton" in tk.triton_error()
assert not tk.should_use_triton("auto", x)
assert torch.allclose(TorchLocal().rms_norm(x, w, 1e-5), x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5))
try:
    tk.rms_norm(x, w, 1e-5)
except ImportError as e:
    print("ERROR", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR parlay.triton_kernels.rms_norm needs a working Triton (ModuleNotFoundError: " in out.stdout, out.stdout
