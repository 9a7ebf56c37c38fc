"""Pipeline parallelism: every schedule, p in {2, 4}, m in {p, 2p}, alone and with dp/tp/fsdp/zero2
beside it, on the numpy simulator, on torch gloo ranks and on JAX (explicit: one compiled tick loop in
shard_map; mpmd: a shard_map per stage on its pp rank's devices; GSPMD), against the one-device run.

The GPT (tiny sizes, dropout 0.1 on: the masks are keyed by the batch's rows, so every
microbatch draws the whole batch's bits) with 4 layers for p=2 and 8 for p=4 (interleaved and
ZB-V run 2 stages a rank). Checked: the loss and every gradient of one step (1e-5 relative; fp32
sums in another order differ by ~5e-7 of the largest gradient), and the parameters after three
AdamW steps, per tensor as ``parlay compare`` does: the L2 norm of the difference within 2e-3 of
the L2 norm of the distance moved. Not per element: AdamW's first updates are about
lr * g/(|g| + eps), so an element whose gradient is near eps = 1e-8 moves by a different part of
lr in either run (seen: blocks.0.attn.wv[21, 0, 3], gradient 1.8e-9, the smallest of 4096,
3.1e-5 apart after 3 steps at lr 1e-3). Torch's received buffers start as NaN: a value read
before it arrived would poison the loss (the MPMD form of praxis' NaN-filled bubbles).
"""

import dataclasses

import numpy as np
import pytest

from parlay.backends.torch.launch import spawn
from parlay.core import Mesh, ProgramError, get_backend, make_program
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.pipeline import PipelineError
from parlay.core.schedule import ScheduleError

B = 16
STEPS = 3


def _model(layers: int, **changes) -> GPT:
    return GPT(dataclasses.replace(PRESETS["tiny"], layers=layers, dropout=0.1, **changes))



def _batch(model: GPT, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    c = model.config
    return {"tokens": rng.integers(0, c.vocab, (B, c.seq)).astype(np.int32),
            "targets": rng.integers(0, c.vocab, (B, c.seq)).astype(np.int32)}


def _run(session, batch):
    loss, grads = session.loss_and_grads(batch)
    losses = [session.step(batch) for _ in range(STEPS)]
    return loss, grads, losses, session.params()


def _assert_same(got, want, what: str, layers: int):
    (loss, grads, losses, params), (loss1, grads1, losses1, params1) = got, want
    assert abs(loss - loss1) <= 1e-5 * abs(loss1), what
    scale = max(np.abs(g).max() for g in grads1.values())
    for name in grads1:
        np.testing.assert_allclose(grads[name], grads1[name], rtol=0, atol=1e-5 * scale, err_msg=f"{what}: {name}")
    np.testing.assert_allclose(losses, losses1, rtol=1e-5, err_msg=what)
    start = _model(layers).init(0)  # where every backend starts
    for name in params1:
        moved = np.linalg.norm(params1[name] - start[name])
        assert np.linalg.norm(params[name] - params1[name]) <= 2e-3 * moved, f"{what}: {name}"


_REFS: dict = {}


def _reference(backend: str, layers: int):
    key = (backend, layers)
    if key not in _REFS:
        model = _model(layers)
        _REFS[key] = get_backend(backend).run(make_program(model, "dp", Mesh(dp=1), batch=B), _run, _batch(model))
    return _REFS[key]


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]
# (strategy, mesh axes) beside the pipeline, for p = 2 and p = 4
BESIDE = {2: [("pp", dict(pp=2)), ("pp+dp+tp", dict(pp=2, dp=2, tp=2))],
          4: [("pp", dict(pp=4)), ("pp+fsdp", dict(pp=4, dp=2))]}


def _cases():
    for p, beside in BESIDE.items():
        for schedule in SCHEDULES:
            for m in (p, 2 * p):
                for strategy, axes in beside:
                    yield schedule, p, m, strategy, axes


def _marked(case):
    # The pipeline alone (no axis beside it) is the simpler case: with the exhaustive checks (make test-all);
    # so are p=4's cases but ZB-V's and interleaved's at m=2p (the V and the loop's wrap on 4 ranks).
    schedule, p, m, strategy, _ = case
    if strategy == "pp" or (p == 4 and not (schedule in ("zbv", "interleaved") and m == 2 * p)):
        return pytest.param(*case, marks=pytest.mark.exhaustive)
    return case


@pytest.mark.parametrize("schedule, p, m, strategy, axes", [_marked(c) for c in _cases()],
                         ids=[f"{s}-p{p}-m{m}-{st}" for s, p, m, st, _ in _cases()])
def test_numpy_pipeline_equals_one_device(schedule, p, m, strategy, axes):
    layers = 4 * p // 2
    model = _model(layers)
    program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
    got = get_backend("numpy").run(program, _run, _batch(model))
    _assert_same(got, _reference("numpy-single", layers), f"{schedule} p={p} m={m} {strategy}", layers)


# One compiled step a case (a branch per stage and action): seconds here. 1f1b (B), zbv (I and W,
# the V's local turn) and interleaved (the wrap from the last rank to the first) cover the
# lowering's paths by default; the rest with the exhaustive checks. The loop's buffers start as
# NaN, so a slot read before its value arrived would poison the loss.
JAX_CASES = [pytest.param(s, "pp+dp+tp", dict(pp=2, dp=2, tp=2), 2, 4,
                          marks=pytest.mark.slow if s in ("1f1b", "zbv", "interleaved") else pytest.mark.exhaustive)
             for s in SCHEDULES] + [
    pytest.param(s, "pp+dp", dict(pp=2, dp=2), 4, 4, marks=pytest.mark.exhaustive) for s in SCHEDULES] + [
    pytest.param("interleaved", "pp+fsdp", dict(pp=4, dp=2), 4, 8, marks=pytest.mark.exhaustive),
    pytest.param("zbv", "pp+fsdp", dict(pp=4, dp=2), 4, 8, marks=pytest.mark.exhaustive),
    pytest.param("zb-h1", "pp", dict(pp=4), 8, 8, marks=pytest.mark.exhaustive),
    pytest.param("1f1b", "pp+dp", dict(pp=4, dp=2), 8, 8, marks=pytest.mark.exhaustive),
    pytest.param("gpipe", "pp+tp", dict(pp=4, tp=2), 4, 8, marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("schedule, strategy, axes, m, layers", JAX_CASES)
def test_jax_pipeline_equals_one_device(schedule, strategy, axes, m, layers):
    # JAX explicit: the whole step one jitted shard_map, a tick loop over the schedule's table.
    model = _model(layers)
    program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
    got = get_backend("jax").run(program, _run, _batch(model))
    _assert_same(got, _reference("jax-single", layers), f"jax {schedule} {strategy} m={m}", layers)


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule, p, m, strategy, axes", list(_cases()),
                         ids=[f"{s}-p{p}-m{m}-{st}" for s, p, m, st, _ in _cases()])
def test_jax_pipeline_every_schedule_p_and_m(schedule, p, m, strategy, axes):
    # The whole matrix on the JAX loop: every schedule, p in {2, 4}, m in {p, 2p}, alone
    # and with dp+tp (p=2) or fsdp (p=4) beside it.
    test_jax_pipeline_equals_one_device(schedule, strategy, axes, m, 4 * p // 2)


@pytest.mark.parametrize("schedule, strategy, axes, m, layers", [
    pytest.param("1f1b", "pp+dp+tp", dict(pp=2, dp=2, tp=2), 4, 4, marks=pytest.mark.slow),
    pytest.param("zbv", "pp+dp+tp", dict(pp=2, dp=2, tp=2), 2, 4, marks=pytest.mark.exhaustive),
    pytest.param("interleaved", "pp+fsdp", dict(pp=4, dp=2), 4, 8, marks=pytest.mark.exhaustive)])
def test_jax_mpmd_pipeline_equals_one_device(schedule, strategy, axes, m, layers):
    # --mode mpmd: each stage a jitted shard_map on its pp rank's sub-mesh, driven by run_pipeline.
    model = _model(layers)
    program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
    got = get_backend("jax-mpmd").run(program, _run, _batch(model))
    _assert_same(got, _reference("jax-single", layers), f"jax-mpmd {schedule} {strategy} m={m}", layers)


def _loss_with_table(session, batch, edit):
    """The loop's loss after ``edit(table)`` changed its (numpy) table of ticks."""
    from parlay.backends.jax.distributed import put

    plan = session.train_plan
    table = plan.table.copy()
    edit(table)
    session.tables[id(plan)] = put(table, session.tables[id(plan)].sharding)
    return session.loss_and_grads(batch)[0]


def test_the_jax_loop_poisons_a_value_read_before_it_arrived():
    # The same step with rank 1 never receiving stage 0's outputs: its slots still hold NaN.
    from parlay.core.ticks import FIELDS, NONE

    model = _model(2)
    program = make_program(model, "pp", Mesh(pp=2), batch=B, microbatches=2, schedule="1f1b")
    cols = slice(len(FIELDS), len(FIELDS) + 2 * 2, 2)  # where the values by shifts 0 and 1 go
    good = get_backend("jax").run(program, _loss_with_table, _batch(model), lambda t: None)
    bad = get_backend("jax").run(program, _loss_with_table, _batch(model), lambda t: t[1, :, cols].fill(NONE))
    assert np.isfinite(good) and np.isnan(bad), (good, bad)


class Widening:
    """A pipelined model whose layer i has an MLP of width 8 (i + 1): its stages' parameters differ."""

    def __init__(self, layers=4, dim=8, vocab=16, seq=4):
        self.n, self.dim, self.vocab, self.seq = layers, dim, vocab, seq

    def decls(self):
        from parlay.core import ParamDecl

        out = [ParamDecl("embed", (self.vocab, self.dim), ("vocab", "embed"))]
        for i in range(self.n):
            out += [ParamDecl(f"up.{i}", (self.dim, 8 * (i + 1)), ("embed", "mlp")),
                    ParamDecl(f"down.{i}", (8 * (i + 1), self.dim), ("mlp", "embed"))]
        return tuple(out)

    def inputs(self, batch):
        from parlay.core import DType, InputDecl

        return {"tokens": InputDecl((batch, self.seq), ("batch", "seq"), DType.INT32, high=self.vocab)}

    def init(self, seed):
        rng = np.random.default_rng(seed)
        return {d.name: rng.normal(0, 0.1, d.shape).astype(np.float32) for d in self.decls()}

    def layers(self):
        return self.n

    def residual(self, batch):
        return (batch, self.seq, self.dim), ("batch", "seq", "embed")

    def embed(self, ops, params, batch):
        return ops.embed(ops.param("embed", params["embed"], ("vocab", "embed")), batch["tokens"])

    def layer(self, ops, params, i, x):
        up = ops.param(f"up.{i}", params[f"up.{i}"], ("embed", "mlp"))
        down = ops.param(f"down.{i}", params[f"down.{i}"], ("mlp", "embed"))
        return ops.add(x, ops.einsum("bsm,me->bse", ops.gelu(ops.einsum("bse,em->bsm", x, up)), down))

    def head(self, ops, params, x, batch):
        return ops.cross_entropy(ops.einsum("bse,ve->bsv", x, ops.param("embed", params["embed"], ("vocab", "embed"))),
                                 batch["tokens"])

    def loss(self, ops, params, batch):
        x = self.embed(ops, params, batch)
        for i in range(self.n):
            x = self.layer(ops, params, i, x)
        return self.head(ops, params, x, batch)


def test_the_jax_loop_refuses_stages_of_other_shapes_and_mpmd_runs_them():
    model = Widening()
    program = make_program(model, "pp", Mesh(pp=2), batch=8, microbatches=2, schedule="1f1b")
    batch = {"tokens": np.random.default_rng(0).integers(0, 16, (8, 4)).astype(np.int32)}
    with pytest.raises(PipelineError, match=r"(?s)stacks stage s's parameters on stage 0's; Widening's stages differ "
                                            r"\(run it with --mode mpmd, backend jax-mpmd.*stage 1's up.2 has shape \(8, 24\), "
                                            r"stage 0's up.0 \(8, 8\)"):
        get_backend("jax").run(program, lambda s, b: s.loss_and_grads(b), batch)
    loss, grads = get_backend("jax-mpmd").run(program, lambda s, b: s.loss_and_grads(b), batch)
    ref_loss, ref_grads = get_backend("jax-single").run(make_program(model, "dp", Mesh(dp=1), batch=8),
                                                        lambda s, b: s.loss_and_grads(b), batch)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for k in ref_grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=0, atol=1e-5 * np.abs(ref_grads[k]).max())


def _temp_bytes(session, batch):
    plan = session.train_plan
    return session.compiled_step(batch).memory_analysis().temp_size_in_bytes, plan.x_slots + plan.dy_slots


@pytest.mark.slow
def test_the_jax_loop_holds_what_the_schedule_holds():
    # XLA's own account of the compiled step: doubling m adds GPipe's m stage inputs (one slot each)
    # and leaves 1F1B's where they were. 2% of the growth allows for alignment.
    model = _model(2)
    x_bytes = (B // 4) * model.config.seq * model.config.embed * 4  # a stage input of m=4's microbatches
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            program = make_program(model, "pp", Mesh(pp=2), batch=m * (B // 4), microbatches=m, schedule=schedule)
            rng = np.random.default_rng(0)
            batch = {k: rng.integers(0, model.config.vocab, (m * B // 4, model.config.seq)).astype(np.int32)
                     for k in ("tokens", "targets")}
            temp[(schedule, m)] = get_backend("jax").run(program, _temp_bytes, batch)
    (g4, s4), (g8, s8) = temp[("gpipe", 4)], temp[("gpipe", 8)]
    assert s8 - s4 == 4
    assert abs((g8 - g4) - 4 * x_bytes) <= 0.02 * 4 * x_bytes, (g8 - g4, x_bytes)
    assert temp[("1f1b", 8)] == temp[("1f1b", 4)], temp


@pytest.mark.slow
@pytest.mark.parametrize("schedule, strategy, axes, m", [("zbv", "pp+dp+tp", dict(pp=2, dp=2, tp=2), 2),
                                                        ("1f1b", "pp+fsdp", dict(pp=2, dp=2), 4)])
def test_jax_gspmd_pipeline_equals_one_device(schedule, strategy, axes, m):
    # GSPMD: the same driver, each stage a jitted function of global arrays on its sub-mesh.
    model = _model(4)
    program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
    got = get_backend("jax-gspmd").run(program, _run, _batch(model))
    _assert_same(got, _reference("jax-single", 4), f"gspmd {schedule} {strategy}", 4)


def torch_pipeline_cases(rank, cases):
    """Every (schedule, strategy, axes, m, layers) in one spawn: loss, gradients, losses, params."""
    from parlay.backends.torch.session import TorchSession

    out = {}
    for schedule, strategy, axes, m, layers in cases:
        model = _model(layers)
        program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
        session = TorchSession(program, model.init(0))
        out[(schedule, strategy, m)] = _run(session, _batch(model))
    return out if rank == 0 else None


def _check_torch(cases, ranks: int) -> None:
    """``cases`` in one spawn of ``ranks`` gloo ranks, each against the one-process torch run."""
    results = spawn(torch_pipeline_cases, ranks, cases, timeout_s=900)[0]
    for schedule, strategy, _, m, layers in cases:
        _assert_same(results[(schedule, strategy, m)], _reference("torch-single", layers),
                     f"{schedule} {strategy} m={m}", layers)


@pytest.mark.slow
def test_torch_pipeline_on_4_ranks_every_schedule():
    _check_torch([(s, "pp+dp", dict(pp=2, dp=2), m, 4) for s in SCHEDULES for m in (2, 4)], 4)


@pytest.mark.exhaustive
def test_torch_pipeline_on_4_stage_ranks_every_schedule():
    _check_torch([(s, "pp", dict(pp=4), m, 8) for s in SCHEDULES for m in (4, 8)], 4)


@pytest.mark.slow
def test_torch_pipeline_on_8_ranks_with_dp_tp_fsdp_zero2():
    cases = [("1f1b", "pp+dp+tp", dict(pp=2, dp=2, tp=2), 2, 4), ("zbv", "pp+zero2+tp", dict(pp=2, dp=2, tp=2), 4, 4),
             ("interleaved", "pp+fsdp", dict(pp=4, dp=2), 4, 8), ("zb-h1", "pp+dp", dict(pp=4, dp=2), 8, 8),
             ("gpipe", "pp+tp_sp", dict(pp=4, tp=2), 4, 8)]
    _check_torch(cases, 8)


def test_pipeline_assigns_stages_by_placement():
    program = make_program(_model(8), "pp+dp", Mesh(pp=4, dp=2), batch=B, microbatches=4, schedule="zbv")
    pipe = program.pipeline
    assert pipe.layers_of_stage == tuple((i,) for i in range(8))
    assert [pipe.schedule.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert "embed.table" in pipe.params_of_stage[0] and "lm_head.w" in pipe.params_of_stage[7]
    assert pipe.rank_of_param("lm_head.w") == 0 and pipe.rank_of_param("blocks.4.mlp.w_in") == 3
    program = make_program(_model(8), "pp", Mesh(pp=4), batch=B, microbatches=4, schedule="1f1b")
    assert program.pipeline.layers_of_stage == ((0, 1), (2, 3), (4, 5), (6, 7))


@pytest.mark.parametrize("kwargs, match", [
    (dict(model=_model(3), mesh=Mesh(pp=2), microbatches=2, schedule="1f1b"),
     r"its 3 layers do not divide into 2 stages \(2 ranks x 1 stages each, 1f1b\)"),
    (dict(model=_model(4), mesh=Mesh(pp=2), microbatches=3, schedule="interleaved", batch=12),
     r"microbatches=3 is not a multiple of p=2"),
    (dict(model=_model(4), mesh=Mesh(pp=2), microbatches=3, schedule="1f1b"),
     r"batch 16 in 3 microbatches:\n  - a step's batch is split into equal microbatches; 16 is not divisible by 3"),
    # every problem at once: the batch's cut, the schedule's microbatches and the layers
    (dict(model=_model(2), mesh=Mesh(pp=4), microbatches=3, schedule="interleaved", batch=8),
     r"cannot be pipelined over pp=4 with batch 8 in 3 microbatches:\n  - .*8 is not divisible by 3.*\n  - "
     r"interleaved 1F1B needs at least p=4 microbatches.*\n  - its 2 layers do not divide into 8 stages"),
    (dict(model=_model(4), mesh=Mesh(pp=2), microbatches=2, schedule="dualpipe"), r"schedule 'dualpipe' is unknown"),
])
def test_pipeline_refuses_clearly(kwargs, match):
    kwargs = {"strategy": "pp", "batch": B, **kwargs}
    with pytest.raises((PipelineError, ScheduleError, ProgramError), match=match):
        make_program(kwargs.pop("model"), kwargs.pop("strategy"), kwargs.pop("mesh"), **kwargs)


def test_a_schedule_without_a_pipeline_is_refused():
    with pytest.raises(ProgramError, match=r"schedule 'zbv' needs a pipeline: map the model's layers to a mesh axis"):
        make_program(_model(4), "dp", Mesh(dp=2), batch=B, schedule="zbv")


def test_a_model_without_stages_is_refused():
    from parlay.core import DType, InputDecl, ParamDecl

    class Classifier:  # a Model, but not a PipelineModel
        def decls(self):
            return (ParamDecl("w", (8, 4), ("feat", "cls")),)

        def inputs(self, batch):
            return {"x": InputDecl((batch, 8), ("batch", "feat"), DType.FLOAT32),
                    "y": InputDecl((batch,), ("batch",), DType.INT32, high=4)}

        def loss(self, ops, params, batch):
            return ops.cross_entropy(ops.einsum("bf,fc->bc", batch["x"], ops.param("w", params["w"], ("feat", "cls"))),
                                     batch["y"])

    with pytest.raises(PipelineError, match=r"model Classifier cannot be pipelined over pp=2 with batch 8 in 2 "
                                            r"microbatches:\n  - it lacks layers\(\), "
                                            r"residual\(\), embed\(\), layer\(\), head\(\)"):
        make_program(Classifier(), "pp+dp", Mesh(pp=2, dp=2), batch=8, microbatches=2)


def _step_collectives(session, batch):
    """The backward's gradient sums (source op); the stage-to-stage sends (p2p) grow with m."""
    session.step(batch)
    return session.log.counts(backward=True, source="op")


@pytest.mark.slow
def test_torch_pipeline_reduces_each_stages_gradients_once_per_step():
    model = _model(4)
    counts = {m: get_backend("torch").run(make_program(model, "pp+dp", Mesh(pp=2, dp=2), batch=B, microbatches=m,
                                                       schedule="zb-h1"), _step_collectives, _batch(model))
              for m in (2, 8)}
    assert counts[2] == counts[8] and counts[2], counts


def tied_cases(rank, cases):
    """A GPT whose LM head is its embedding table, pipelined: losses, gradients, parameters."""
    from parlay.backends.torch.session import TorchSession

    out = {}
    for schedule, strategy, axes, m in cases:
        model = _model(4, tie_embeddings=True)
        program = make_program(model, strategy, Mesh(**axes), batch=B, microbatches=m, schedule=schedule)
        out[(schedule, strategy)] = _run(TorchSession(program, model.init(0)), _batch(model))
    return out if rank == 0 else None


@pytest.mark.slow
def test_a_tied_table_across_stages_sums_its_gradients():
    # 1f1b puts the table's two uses on pp ranks 0 and 1 (their gradients summed over pp, both
    # copies updated alike); zbv puts both on rank 0 (the V's ends).
    model = _model(4, tie_embeddings=True)
    program = make_program(model, "pp+dp", Mesh(pp=2, dp=2), batch=B, microbatches=2, schedule="1f1b")
    assert program.pipeline.shared_params == ("embed.table",) and program.pipeline.ranks_of_param("embed.table") == (0, 1)
    ref_np = get_backend("numpy-single").run(make_program(model, "dp", Mesh(dp=1), batch=B), _run, _batch(model))
    _assert_same(get_backend("numpy").run(program, _run, _batch(model)), ref_np, "numpy 1f1b tied", 4)
    ref = get_backend("torch-single").run(make_program(model, "dp", Mesh(dp=1), batch=B), _run, _batch(model))
    cases = [("1f1b", "pp+dp", dict(pp=2, dp=2), 2), ("zbv", "pp+zero2", dict(pp=2, dp=2), 2),
             ("gpipe", "pp+tp", dict(pp=2, tp=2), 4)]
    for key, got in spawn(tied_cases, 4, cases, timeout_s=600)[0].items():
        _assert_same(got, ref, f"torch {key} tied", 4)
    ref_jax = get_backend("jax-single").run(make_program(model, "dp", Mesh(dp=1), batch=B), _run, _batch(model))
    _assert_same(get_backend("jax").run(program, _run, _batch(model)), ref_jax, "jax 1f1b tied", 4)
