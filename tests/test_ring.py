"""Ring attention (core/ring.py) and the ring strategies.

The op: output, log-sum-exp, dq, dk and dv of ``ring_forward``/``ring_backward`` on every rank's
block equal full attention computed in float64 on the global arrays, on the numpy simulator, JAX
(shard_map, lax.ppermute) and torch (gloo, P2P): rings of 1 to 8 ranks, causal and not, zigzag and
contiguous, grouped-query heads, a ring over two mesh axes next to a data axis. Every rank's K and
V differ, so a backward that reused one block (diffusers#14265) fails. Bound: 2e-5 of the largest
reference element (fp32 sums in another order; measured at most 5.5e-7 on the simulator).

The bytes: each rank's shifts send 2 (n-1)/n s d_kv b elements forward (an all-gather's volume),
and K, V plus float32 dK, dV backward (``ring_traffic``), counted by torch's and JAX's logs.

The strategies (``ring``, ``ring_contiguous``, combined with dp, fsdp, tp): loss and gradients
equal one device on torch, JAX explicit, JAX GSPMD and numpy through ``parlay compare`` (fp32, its
tolerances: loss 1e-5, gradients 1e-4).
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import ring_cases as rc
from parlay import Mesh
from parlay.backends.jax.comm import JaxComm
from parlay.backends.jax.mesh import AtomMesh
from parlay.backends.numpy.comm import NumpyComm
from parlay.backends.numpy.ops import PerRank
from parlay.compare import run_compare
from parlay.core import Kind
from parlay.core.log import CollectiveLog
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import ProgramError, make_program
from parlay.core.ring import ring_traffic, ring_work, zigzag_order
from parlay.core.strategies import STRATEGIES, Strategy


def _traffic(case, x_itemsize=4):
    ring = rc.ring_of(case)
    q, k, _, _ = rc.arrays(case)
    return ring_traffic(ring.n, batch=k.shape[0], seq=k.shape[1], kv_heads=k.shape[2], head_dim=k.shape[3],
                        itemsize=x_itemsize)


@pytest.mark.parametrize("case", rc.CASES, ids=rc.key)
def test_ring_op_equals_full_attention_in_the_simulator(case):
    mesh = Mesh(case[0])
    comm = NumpyComm(mesh)
    xs = [PerRank(rc.block(case, x, r) for r in range(mesh.size)) for x in rc.arrays(case)]
    outs = rc.local_run(comm.local, comm, case, *xs)
    rc.check(case, [rc.assemble(case, o.values) for o in outs])


@pytest.mark.parametrize("case", rc.CASES, ids=rc.key)
def test_ring_op_equals_full_attention_on_jax(case):
    mesh, ring = Mesh(case[0]), rc.ring_of(case)
    atoms = AtomMesh(mesh)
    log = CollectiveLog()

    def local(*xs):
        comm = JaxComm(atoms, log)
        return rc.local_run(comm.local, comm, case, *xs)

    spec = PartitionSpec(None, atoms.names(ring.axes))
    order = rc.order(case)
    fn = jax.jit(jax.shard_map(local, mesh=atoms.jax_mesh(), in_specs=(spec,) * 4, out_specs=(spec,) * 5))
    outs = fn(*(x[:, order] for x in rc.arrays(case)))
    unpermute = lambda y: np.asarray(y)[:, np.argsort(order)]
    rc.check(case, [unpermute(o) for o in outs])
    want = _traffic(case)
    assert log.bytes(backward=False, source="plan") == want["forward"]
    assert log.bytes(backward=True, source="plan") == want["backward"]
    assert {e.kind for e in log.entries} <= {Kind.PERMUTE}


def test_a_custom_op_over_inputs_that_vary_differently_sums_the_invariant_ones_gradient():
    """``Comm.custom`` on JAX with one input split over x and one replicated (and an axis of size
    1 that JAX tracks separately): the replicated input's gradient is the sum over x of every
    rank's share. A random rule set found the case (attention's sequence split over (y=1, x=4)):
    before, JAX refused the gradient's type."""
    from parlay.backends.jax.comm import custom_op

    atoms = AtomMesh(Mesh({"x": 4, "y": 1}))
    x_names, y_names = atoms.names(("x",)), atoms.names(("y",))

    def local(a, b):
        a = jax.lax.pcast(a, y_names, to="varying")  # varies over y (size 1) as well; b over nothing
        fwd = lambda a, b: (a * b, (a, b))
        bwd = lambda res, g: (g * res[1], g * res[0])
        return custom_op(fwd, bwd, a, b)

    fn = jax.shard_map(local, mesh=atoms.jax_mesh(), in_specs=(PartitionSpec(x_names), PartitionSpec()),
                       out_specs=PartitionSpec((*x_names, *y_names)))
    rng = np.random.default_rng(0)
    a, b, w = rng.standard_normal(8), rng.standard_normal(2), rng.standard_normal(8)
    da, db = jax.jit(jax.grad(lambda a, b: (fn(a, b) * w).sum(), argnums=(0, 1)))(a, b)
    np.testing.assert_allclose(da, w * np.tile(b, 4), rtol=1e-6)
    np.testing.assert_allclose(db, (w * a).reshape(4, 2).sum(0), rtol=1e-6)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_ring_sends_an_all_gathers_volume_of_k_and_v_forward(n):
    """2 (n-1)/n s d_kv b elements per rank per attention, written out from the formula."""
    b, s, kv, d = 2, 64, 2, 8
    t = ring_traffic(n, batch=b, seq=s, kv_heads=kv, head_dim=d, itemsize=2)
    assert t["forward"] * n == 2 * (n - 1) * s * kv * d * b * 2
    assert t["backward"] == t["forward"] + 2 * n * (s // n) * kv * d * b * 4  # dK, dV float32, one more shift home


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(n):
    seq = 16 * n
    causal_pairs = seq * (seq + 1) // 2
    zig = ring_work(n, seq, causal=True, zigzag=True)
    assert {w["useful"] for w in zig} == {causal_pairs // n}  # the triangle, split evenly
    assert len({w["computed"] for w in zig}) == 1
    # each step after the first: two (chunk x chunk) pairs, half of a contiguous ring's block
    c = seq // (2 * n)
    assert zig[0]["computed"] == (2 * c) ** 2 + (n - 1) * 2 * c * c
    flat = ring_work(n, seq, causal=True, zigzag=False)
    useful = [w["useful"] for w in flat]
    assert sum(useful) == causal_pairs and max(useful) / np.mean(useful) > 2 * n / (n + 1) - 1e-9


def test_zigzag_order_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    order = zigzag_order(16, 4)  # 8 chunks of 2
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


# -- the strategies, through parlay compare --------------------------------------------------------------

def _compare(model, strategy, axes, backends, steps=2):
    program = make_program(GPT(PRESETS[model]), strategy, Mesh(axes), batch=8)
    _, runs = run_compare(program, steps=steps, backends=tuple(backends), bisect=False)
    assert [r.name for r in runs] == list(backends)
    for run in runs:
        assert run.agree, (strategy, axes, run.name, run.loss_diff, run.grad_diff, run.worst_grad, run.param_diff)
    return runs


def test_dp_ring_tp_equals_one_device_on_every_backend():
    """Zigzag ring over cp=2 with data and tensor parallelism on 8 ranks, GQA (8 query heads, 4
    kv heads, split over tp)."""
    _compare("tiny-gqa", "dp+ring+tp", {"dp": 2, "cp": 2, "tp": 2}, ["torch", "jax", "jax-gspmd", "numpy"])


def test_fsdp_ring_with_learned_positions_equals_one_device():
    """The position table's rows follow the zigzag order where used (its gradient scatters back)."""
    _compare("tiny-gpt2-hf", "fsdp+ring", {"dp": 2, "cp": 4}, ["jax", "numpy"])


@pytest.mark.exhaustive
@pytest.mark.parametrize("model, strategy, axes", [
    ("tiny-gqa", "ring", {"cp": 4}),
    ("tiny-gqa", "ring", {"cp": 2}),
    ("tiny-gqa", "dp+ring", {"dp": 2, "cp": 4}),
    ("tiny-gqa", "ring+tp", {"cp": 4, "tp": 2}),
    ("tiny", "ring_contiguous+tp_sp", {"cp": 2, "tp": 2}),
    ("tiny-gpt2-hf", "fsdp+ring", {"dp": 2, "cp": 4}),
])
def test_ring_strategies_equal_one_device(model, strategy, axes):
    _compare(model, strategy, axes, ["torch", "jax", "jax-gspmd"])


def test_a_ring_renamed_to_other_axes_keeps_its_zigzag():
    s = STRATEGIES["ring"].on("ctx")
    assert s.zigzag == ("ctx",) and s.rules("activations").resolve(("batch", "attn_seq"), Mesh(ctx=2)).entries == (
        (), ("ctx",))
    program = make_program(GPT(PRESETS["tiny"]), s, Mesh(ctx=2), batch=4)
    assert program.seq_order.axes == ("ctx",) and program.seq_order.n == 2


# -- what the ring refuses, with the fix ---------------------------------------------------------------------

def test_zigzag_needs_a_sequence_divisible_by_twice_the_ring():
    with pytest.raises(ProgramError, match=r"splits the sequence into 32 chunks, but it has 16 positions"):
        make_program(GPT(PRESETS["tiny"]), "ring", Mesh(cp=16), batch=4)


def test_zigzag_and_a_pipeline_are_refused():
    with pytest.raises(ProgramError, match="zigzag .* and a pipeline do not combine"):
        make_program(GPT(PRESETS["tiny"]), "ring+pp", Mesh(cp=2, pp=2), batch=4)


def test_zigzag_refuses_dropout_with_the_fix():
    from dataclasses import replace

    model = GPT(replace(PRESETS["tiny"], dropout=0.1))
    program = make_program(model, "ring", Mesh(cp=2), batch=4)
    from parlay.core.session import get_backend

    batch = {k: np.zeros(d.shape, np.int32) for k, d in program.inputs.items()}
    with pytest.raises(ValueError, match="dropout .* laid out zigzag .* use ring_contiguous"):
        get_backend("numpy").run(program, lambda s: s.loss_and_grads(batch))


def test_zigzag_with_attention_over_other_axes_is_refused():
    """A user's rule set lays the sequence out zigzag over cp but keeps it whole in attention: the
    causal mask would see positions out of order."""
    s = Strategy("mine", activations=[("seq", "cp"), ("proj_seq", "cp")], zigzag=("cp",))
    program = make_program(GPT(PRESETS["tiny"]), s, Mesh(cp=2), batch=4)
    from parlay.core.session import get_backend

    batch = {k: np.zeros(d.shape, np.int32) for k, d in program.inputs.items()}
    with pytest.raises(ValueError, match=r"laid out zigzag over \['cp'\], but attention splits it over nothing"):
        get_backend("numpy").run(program, lambda s: s.loss_and_grads(batch))
