"""``collective_traffic`` (backends/jax/memory.py: one step traced on shapes, no device) counts
what torch's collectives send: every plan step of the forward and of the backward and every op's
own sum (``vary``'s gradient sums, ``psum``), by kind and mesh axes, on rank 0, equal in count and
bytes, for 1D, 2D, 2.5D and 3D tensor parallelism and the data and sequence strategies beside
them (8 gloo ranks, gradient buckets off so each parameter's sum is one record)."""

import workers
from parlay import Mesh
from parlay.backends.jax.memory import collective_traffic
from parlay.backends.torch.launch import spawn
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program

CASES = [("tp3d", [("x", 2), ("y", 2), ("z", 2)]), ("tp2.5d", [("row", 2), ("col", 2), ("dep", 2)]),
         ("dp+tp2d", [("dp", 2), ("row", 2), ("col", 2)]), ("fsdp+tp_sp", [("dp", 2), ("tp", 4)]),
         ("dp+ulysses", [("dp", 2), ("sp", 4)]), ("dp+tp", [("dp", 2), ("tp", 4)])]


def _static(strategy, axes):
    log = collective_traffic(make_program(GPT(PRESETS["tiny"]), strategy, Mesh(dict(axes)), batch=8))
    out: dict = {}
    for e in log.entries:
        if e.kind.value != "local-slice":
            key = (e.kind.value, e.axes, e.backward, e.source.value)
            c, n = out.get(key, (0, 0))
            out[key] = (c + 1, n + e.nbytes)
    return out


def test_traced_traffic_equals_what_torch_sends():
    seen = spawn(workers.step_traffic, 8, "tiny", CASES, timeout_s=600)[0]
    for strategy, axes in CASES:
        torch_counts = seen[workers._key(strategy, axes)]
        assert torch_counts, strategy
        if strategy.startswith("tp"):  # 2D, 2.5D, 3D: gathers forward, reduce-scatters backward
            assert any(backward and source == "plan" for _, _, backward, source in torch_counts), strategy
        assert any(source == "op" for *_, source in torch_counts), strategy
        assert _static(strategy, axes) == torch_counts, strategy
