"""``parlay plan``'s collectives (planning.py: the forward and backward traced on shapes by
``collective_traffic``, no device; the optimizer step's moves from its plans) are what torch's
session sends in one training step: every plan step of the forward, the backward and the
optimizer step, and every op's own sum (``vary``'s gradient sums, ``psum``), by kind and mesh
axes, on rank 0, equal in count and bytes, for every built-in strategy but pp (8 gloo ranks,
gradient buckets off so each parameter's sum is one record)."""

import workers
from parlay import Mesh
from parlay.backends.torch.launch import spawn
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program
from parlay.planning import PHASES, plan_report

# Every built-in strategy but pp at least once: dp, zero1, zero2, fsdp, tp, tp_sp, ulysses, ring,
# ring_contiguous, tp2d, tp2.5d, tp3d.
CASES = [("tp3d", [("x", 2), ("y", 2), ("z", 2)]), ("tp2.5d", [("row", 2), ("col", 2), ("dep", 2)]),
         ("dp+tp2d", [("dp", 2), ("row", 2), ("col", 2)]), ("fsdp+tp_sp", [("dp", 2), ("tp", 4)]),
         ("dp+ulysses", [("dp", 2), ("sp", 4)]), ("zero1+tp", [("dp", 2), ("tp", 4)]),
         ("zero2+tp_sp", [("dp", 2), ("tp", 4)]), ("fsdp+ring", [("dp", 2), ("cp", 4)]),
         ("dp+ring_contiguous", [("dp", 2), ("cp", 4)])]


def _static(strategy, axes):
    report = plan_report(make_program(GPT(PRESETS["tiny"]), strategy, Mesh(dict(axes)), batch=8))
    return workers.traffic_counts([r for phase in PHASES for r in report.records[phase]])


def test_traced_traffic_equals_what_torch_sends():
    seen = spawn(workers.step_traffic, 8, "tiny", CASES, timeout_s=600)[0]
    for strategy, axes in CASES:
        torch_counts = seen[workers._key(strategy, axes)]
        assert torch_counts, strategy
        if strategy.startswith("tp"):  # 2D, 2.5D, 3D: gathers forward, reduce-scatters backward
            assert any(backward and source == "plan" for _, _, backward, source in torch_counts), strategy
        assert any(source == "op" for *_, source in torch_counts), strategy
        assert _static(strategy, axes) == torch_counts, strategy
