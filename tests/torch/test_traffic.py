"""``parlay plan``'s collectives (planning.py: the forward and backward traced on shapes by
``collective_traffic``, no device; the optimizer step's moves from its plans) are what torch's
session sends in one training step: every plan step of the forward, the backward and the
optimizer step, and every op's own sum (``vary``'s gradient sums, ``psum``), by kind and mesh
axes, on rank 0, equal in count and bytes, for every built-in strategy (pp below), in bf16 and
bf16-sum16, and under remat, whose recomputation runs a layer's collectives again (8 gloo ranks,
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


# Mixed precision: bf16's sums widen to float32 (their bytes are float32's); bf16-sum16 sends an
# activation's sums in bfloat16 and a parameter's in float32. Remat: torch's checkpoint runs a
# layer's collectives again in the backward, up to its last op that keeps a tensor.
OPTIONS = [("fsdp+tp_sp", [("dp", 2), ("tp", 4)], {"precision": "bf16"}),
           ("fsdp+tp_sp", [("dp", 2), ("tp", 4)], {"precision": "bf16-sum16"}),
           ("dp+tp", [("dp", 2), ("tp", 4)], {"precision": "bf16-sum16"}),
           ("dp+tp", [("dp", 2), ("tp", 4)], {"remat": "block"}), ("fsdp+tp_sp", [("dp", 2), ("tp", 4)], {"remat": "block"}),
           ("dp+ulysses", [("dp", 2), ("sp", 4)], {"remat": "selective"}),
           ("fsdp+ring", [("dp", 2), ("cp", 4)], {"remat": "block"}),
           ("tp3d", [("x", 2), ("y", 2), ("z", 2)], {"remat": "selective"}),
           ("dp+tp2d", [("dp", 2), ("row", 2), ("col", 2)], {"remat": "block"})]


def _static(strategy, axes, **options):
    report = plan_report(make_program(GPT(PRESETS["tiny"]), strategy, Mesh(dict(axes)), batch=8, **options))
    return workers.traffic_counts([r for phase in PHASES for r in report.records[phase]])


def _bytes(counts, axis):
    return sum(n for (_, axes, *_), (_, n) in counts.items() if axis in axes)


def test_traced_traffic_equals_what_torch_sends():
    seen = spawn(workers.step_traffic, 8, "tiny", CASES + OPTIONS, timeout_s=600)[0]
    for strategy, axes in CASES:
        torch_counts = seen[(workers._key(strategy, axes),)]
        assert torch_counts, strategy
        if strategy.startswith("tp"):  # 2D, 2.5D, 3D: gathers forward, reduce-scatters backward
            assert any(backward and source == "plan" for _, _, backward, source in torch_counts), strategy
        assert any(source == "op" for *_, source in torch_counts), strategy
        assert _static(strategy, axes) == torch_counts, strategy
    for strategy, axes, options in OPTIONS:
        torch_counts = seen[(workers._key(strategy, axes), *sorted(options.items()))]
        assert _static(strategy, axes, **options) == torch_counts, (strategy, options)
        if "remat" in options:  # the recomputation's collectives are there: more than without remat
            plain = seen.get((workers._key(strategy, axes),)) or _static(strategy, axes)
            assert sum(c for c, _ in torch_counts.values()) > sum(c for c, _ in plain.values()), strategy
    # the tensor axis's activation sums are half as many bytes in bfloat16; dp's gradient sums are
    # float32 in both
    key = workers._key("fsdp+tp_sp", [("dp", 2), ("tp", 4)])
    wide, narrow = seen[key, ("precision", "bf16")], seen[key, ("precision", "bf16-sum16")]
    assert _bytes(narrow, "tp") < 0.6 * _bytes(wide, "tp"), (_bytes(narrow, "tp"), _bytes(wide, "tp"))
    assert _bytes(narrow, "dp") == _bytes(wide, "dp")


# Microbatches (8 ranks): each one's forward and backward collectives, the gradient sums once. Under
# a pipeline: rank 0's stages' collectives each microbatch (a zero-bubble schedule's input and
# weight passes each with their own), its sends to the next pp rank and back, the tied table's sum
# over pp, its own parameters' optimizer moves.
PIPELINES = [("tiny", 2, "zero1+tp", [("dp", 4), ("tp", 2)], None, 2),
             ("tiny", 4, "pp+dp+tp", [("pp", 2), ("dp", 2), ("tp", 2)], "1f1b", 4),
             ("tiny", 8, "pp+fsdp", [("pp", 4), ("dp", 2)], "interleaved", 4),
             ("tiny", 4, "pp+tp", [("pp", 2), ("tp", 4)], "zbv", 2),
             ("tiny-gpt2-hf", 2, "pp+dp", [("pp", 2), ("dp", 4)], "1f1b", 2),  # a tied table
             ("tiny", 4, "pp+fsdp+tp_sp", [("pp", 2), ("dp", 2), ("tp", 2)], "1f1b", 2, "block"),  # remat
             ("tiny", 4, "pp+dp+tp", [("pp", 2), ("dp", 2), ("tp", 2)], "zbv", 2, "block")]


def test_the_plan_of_microbatches_and_pipelines_equals_what_torch_sends():
    seen = spawn(workers.pipeline_traffic, 8, PIPELINES, timeout_s=600)[0]
    for preset, layers, strategy, axes, schedule, m, *remat in PIPELINES:
        remat = (remat or ["none"])[0]
        model = GPT(PRESETS[preset].with_(layers=layers))
        report = plan_report(make_program(model, strategy, Mesh(dict(axes)), batch=8, microbatches=m,
                                          schedule=schedule, remat=remat))
        torch_counts = seen[preset, layers, strategy, schedule, remat]
        sends = any(kind == "permute" and source == "p2p" for kind, _, _, source in torch_counts)
        assert sends == (schedule is not None), strategy
        if model.config.tie_embeddings:  # its gradient summed over pp
            assert ("all-reduce", ("pp",), True, "op") in torch_counts, torch_counts
        assert workers.traffic_counts([r for phase in PHASES for r in report.records[phase]]) == torch_counts, \
            (strategy, schedule)
