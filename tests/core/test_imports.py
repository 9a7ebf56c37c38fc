"""Import boundaries: core/ imports only the standard library and numpy; backends import core
(and torch the Triton kernels), never each other nor the top level; the top-level commands import
no backend (they reach one through the registry, by name)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]
CORE = REPO / "core"
BLOCKED = ("torch", "jax", "jaxlib", "flax", "optax", "triton", "einops", "safetensors", "rich")
TOP = ("cli", "compare", "training", "stepping", "bisection", "checkpoint", "hf", "__main__", "__init__")


def _imports(path: Path):
    """(absolute module names inside parlay, third-party top-level names) a file imports."""
    rel = path.relative_to(REPO).with_suffix("")
    package = ["parlay", *rel.parts[:-1]]
    inside, outside = [], []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                (inside if a.name.split(".")[0] == "parlay" else outside).append(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                (inside if node.module.split(".")[0] == "parlay" else outside).append(node.module)
            else:
                base = package[:len(package) - node.level + 1]
                inside.append(".".join(base + ([node.module] if node.module else [])))
    return inside, outside


def _files(folder: Path):
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_modules_import_only_stdlib_numpy_and_core():
    offenders = []
    for path in _files(CORE):
        inside, outside = _imports(path)
        offenders += [f"{path.name}: {n}" for n in outside if n.split(".")[0] not in ("numpy", *sys.stdlib_module_names)]
        offenders += [f"{path.name}: {n}" for n in inside if not n.startswith("parlay.core")]
    assert offenders == []


def test_backends_import_core_only_and_never_each_other():
    offenders = []
    for backend in ("torch", "jax", "numpy"):
        allowed = ("parlay.core", f"parlay.backends.{backend}") + (("parlay.triton_kernels",) if backend == "torch" else ())
        for path in _files(REPO / "backends" / backend):
            inside, _ = _imports(path)
            offenders += [f"{backend}/{path.name}: {n}" for n in inside if not n.startswith(allowed) and n != "parlay"]
    assert offenders == []


def test_top_level_commands_import_no_backend():
    offenders = []
    for name in TOP:
        inside, _ = _imports(REPO / f"{name}.py")
        offenders += [f"{name}.py: {n}" for n in inside if n.startswith("parlay.backends")]
    assert offenders == []


def test_core_and_the_commands_import_with_frameworks_blocked():
    """The command line, compare and train start without torch or JAX: a backend is imported
    when one is asked for by name."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import parlay, parlay.core
import parlay.core.program, parlay.core.session, parlay.core.executor, parlay.compare, parlay.training
import parlay.bisection, parlay.stepping, parlay.core.models.gpt
from parlay import Mesh, P, Layout, plan_redistribute
m = Mesh(dp=2)
plan_redistribute(Layout(m, P('dp')), Layout(m, P()), (4,))
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r})
assert not loaded, loaded
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
