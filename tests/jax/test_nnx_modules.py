"""parlay's layers and GPT as Flax NNX modules (backends/jax/nnx_modules.py): the parameters are
parlay's (names, dims, bits), placed in a strategy's layouts; the logits equal parlay's GSPMD run;
an ordinary NNX loop with ``adamw`` takes parlay's steps; the layers inside a user's own NNX module
run under parlay's strategies and equal one device; checkpoints cross between the NNX loop and
parlay (tests/torch/test_nnx_resume.py: to torch and back)."""

import dataclasses

import numpy as np
import pytest

from parlay.core import Mesh, get_backend, make_program
from parlay.core.loading import load_model
from parlay.core.optim import OptimizerConfig

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

from parlay.flax_nnx import GPT, Layer, Model, adamw, load_checkpoint, save_checkpoint  # noqa: E402

TINY, _ = load_model("tiny")


def _tokens(seed, n=8):
    return np.random.default_rng(seed).integers(0, TINY.config.vocab, (n, TINY.config.seq)).astype(np.int32)


def _flat(module):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def test_the_nnx_gpt_holds_parlays_parameters():
    # Paths are parlay's names, out_sharding its logical dims, the values its initializer's bits;
    # read back as an NnxModel, the module declares what parlay's GPT declares.
    from parlay.backends.jax.nnx import NnxModel

    module, init = GPT("tiny", seed=3), TINY.init(3)
    flat = _flat(module)
    assert set(flat) == set(init)
    for d in TINY.decls():
        assert flat[d.name].get_metadata()["out_sharding"] == d.dims, d.name
        assert np.array_equal(np.asarray(flat[d.name][...]), init[d.name]), d.name
    seen = NnxModel(lambda rngs: GPT("tiny"), lambda m, b: m.loss(b), TINY.inputs)
    assert {(d.name, d.shape, d.dims) for d in seen.decls()} == {(d.name, d.shape, d.dims) for d in TINY.decls()}


def _parlay_gspmd_logits(program, tokens):
    """parlay's own GSPMD run (JaxSession) of the program's model: its placed parameters, and the
    logits of its GSPMD ``Ops`` under jit."""
    def run(session):
        ops = session._dense_ops(False, 0)
        logits = jax.jit(lambda p, t: program.model.logits(ops, p, t))(session.state["params"], tokens)
        return {k: v.sharding for k, v in session.state["params"].items()}, np.asarray(logits)

    return get_backend("jax-gspmd").run(program, run)


@pytest.mark.parametrize("strategy, axes", [("fsdp+tp", dict(dp=2, tp=4)), ("dp+tp_sp", dict(dp=2, tp=4)),
                                            ("tp2d", dict(row=2, col=4)), ("tp3d", dict(x=2, y=2, z=2))],
                         ids=["fsdp+tp", "dp+tp_sp", "tp2d", "tp3d"])
def test_the_sharded_nnx_gpt_equals_parlays_gspmd_run(strategy, axes):
    tokens = _tokens(0)
    program = make_program(TINY, strategy, Mesh(**axes), batch=8)
    shardings, want = _parlay_gspmd_logits(program, tokens)
    module = GPT("tiny", strategy=strategy, mesh=axes, batch=8)
    for name, v in _flat(module).items():
        assert v[...].sharding.spec == shardings[name].spec, name
    got = np.asarray(nnx.jit(lambda m, t: m(t))(module, module.placement.batch({"tokens": tokens, "targets": tokens})
                                                ["tokens"]))
    assert np.array_equal(got, want)  # the same computation, compiled alike: bitwise (measured on all four)
    whole = np.asarray(GPT("tiny")(tokens))  # one device, no constraints (measured at most 2.1e-7 off)
    np.testing.assert_allclose(got, whole, rtol=0, atol=1e-6)


def test_an_ordinary_nnx_loop_takes_parlays_steps():
    # nnx.Optimizer(adamw(cfg)) under nnx.jit, warmup and cosine: the losses and parameters of
    # parlay's own GSPMD session on the same batches (run_train's data: batch_at(t, seed)).
    cfg = OptimizerConfig(lr=3e-3, warmup=2, decay_steps=5)
    program = make_program(TINY, "fsdp+tp", Mesh(dp=2, tp=2), batch=8, optimizer=cfg)
    data = TINY.dataset()
    batches = [data.batch_at(t, 8, seed=0) for t in range(5)]
    want_losses, want = get_backend("jax-gspmd").run(
        program, lambda s: ([s.step(b) for b in batches], s.params()))
    from examples.nnx_gpt import step  # the README's: nnx.jit of nnx.value_and_grad and opt.update

    module = GPT("tiny", strategy="fsdp+tp", mesh=dict(dp=2, tp=2), batch=8)
    opt = nnx.Optimizer(module, adamw(cfg), wrt=nnx.Param)
    losses = [float(step(module, opt, module.placement.batch(b))) for b in batches]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for name, v in _flat(module).items():
        np.testing.assert_allclose(np.asarray(v[...]), want[name], rtol=0, atol=1e-6, err_msg=name)
    assert int(opt.step[...]) == 5


# -- parlay's layers inside a user's own NNX module -------------------------------------------------------

def _user_model():
    """A two-block language model an NNX user writes from parlay's layers (not parlay's GPT):
    learned positions, LayerNorm blocks with biases, GELU MLPs and grouped-query attention."""
    import jax.numpy as jnp

    from parlay import DType, InputDecl
    from parlay.backends.jax.nnx import NnxModel, constrain
    from parlay.core.layers import MLP, Activation, Attention, Block, Embedding, LayerNorm, Linear

    V, S, E, H, K, F = 64, 16, 32, 8, 4, 64

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = Layer(Embedding(V, E), seed=1)
            self.pos = nnx.Param(jnp.asarray(np.random.default_rng(2).normal(0, 0.02, (S, E)), jnp.float32),
                                 out_sharding=(None, "embed"), eager_sharding=False)
            block = lambda: Block(LayerNorm(E), Attention(E, H, K, E // H, 0.01, bias=True), LayerNorm(E),
                                  MLP(E, F, Activation.GELU, 0.01, bias=True))
            self.blocks = nnx.List([Layer(block(), seed=10 + i) for i in range(2)])
            self.head = Layer(Linear((E,), (V,), ("embed",), ("vocab",), bias=True), seed=3)

        def __call__(self, tokens):
            x = constrain(self.embed(tokens) + self.pos[...], ("batch", "seq", "embed"))
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def loss(m, batch):
        logits = m(batch["tokens"])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))

    tok = lambda n: InputDecl((n, S), ("batch", "input_seq"), DType.INT32, high=V)
    return NnxModel(LM, loss, lambda n: {"tokens": tok(n), "targets": tok(n)}, name="LM")


@pytest.mark.parametrize("strategy, axes", [("tp", dict(tp=4)), ("fsdp+tp_sp", dict(dp=2, tp=4))],
                         ids=["tp", "fsdp+tp_sp"])
def test_parlays_layers_in_a_users_nnx_module_equal_one_device(strategy, axes):
    from parlay.compare import Tolerance, run_compare

    model = _user_model()
    assert "blocks.1.attn.wk" in {d.name for d in model.decls()}
    program = make_program(model, strategy, Mesh(**axes), batch=8)
    ref, (run,) = run_compare(program, steps=3, backends=("jax-gspmd",), bisect=False)
    # Losses and first-step gradients as compare judges them. Parameters are not judged here: the
    # head's bias gradient at init is softmax minus target frequencies, elements of 1e-8 whose sign
    # rounding decides, so AdamW steps them +-lr under any layout (dp too: param_diff 3.6e-3).
    tol = Tolerance()
    assert run.loss_diff <= tol.loss and run.grad_diff <= tol.grad, (run.loss_diff, run.grad_diff)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)


def test_a_layer_computes_its_formula():
    # From first principles: x @ w + b; the GELU MLP; a layer holds its parameters by their names.
    from parlay.core.layers import MLP, Activation, Linear

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    lin = Layer(Linear((8,), (5,), ("embed",), ("mlp",), bias=True), params={"w": rng.normal(size=(8, 5)),
                                                                             "b": rng.normal(size=5)})
    w, b = np.asarray(lin.w[...]), np.asarray(lin.b[...])
    np.testing.assert_allclose(np.asarray(lin(x)), x @ w + b, rtol=1e-5, atol=1e-6)
    mlp = Layer(MLP(8, 16, Activation.GELU, 0.02))
    wi, wo = np.asarray(mlp.w_in[...]), np.asarray(mlp.w_out[...])
    h = x @ wi
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))  # parlay's: the tanh form
    np.testing.assert_allclose(np.asarray(mlp(x)), gelu @ wo, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"Layer\(Linear\): params lacks \['b'\]; it declares \['w', 'b'\]"):
        Layer(Linear((8,), (5,), ("embed",), ("mlp",), bias=True), params={"w": np.zeros((8, 5))})


def test_dropout_follows_nnx_train_and_eval():
    from parlay.core.layers import Activation, Block, MLP, Attention, RMSNorm
    from parlay.core.ops import step_words

    block = Layer(Block(RMSNorm(16), Attention(16, 2, 2, 8, 0.02), RMSNorm(16), MLP(16, 32, Activation.GELU, 0.02),
                        dropout=0.5))
    x = np.random.default_rng(0).normal(size=(2, 4, 16)).astype(np.float32)
    off = np.asarray(block(x))
    block.train()
    a, b = np.asarray(block(x, step=0)), np.asarray(block(x, step=step_words(1)))
    block.eval()
    assert np.array_equal(np.asarray(block(x)), off)
    assert not np.allclose(a, off) and not np.allclose(a, b)  # masks on, and drawn per step


def test_what_the_nnx_modules_refuse():
    from parlay.training import TrainSpec

    import optax

    from parlay.backends.jax.nnx import NnxModel
    from parlay.core.layers import Linear

    with pytest.raises(ValueError, match="give strategy=, mesh= and batch= together .*mesh=, batch= missing"):
        Model(TINY, strategy="dp")
    with pytest.raises(TypeError, match="Layer: object is not a parlay layer"):
        Layer(object())
    lin = Linear((8,), (5,), ("embed",), ("mlp",))
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(5, 8\); it declares \(8, 5\)"):
        Layer(lin, params={"w": np.zeros((5, 8))})
    with pytest.raises(ValueError, match=r"params names \['bias'\] that it does not declare; it declares \['w'\]"):
        Layer(lin, params={"w": np.zeros((8, 5)), "bias": np.zeros(5)})
    with pytest.raises(ValueError, match=r"GPT: input 'tokens' has shape \(8, 32\); the model takes \(8, 16\)"):
        GPT("tiny")(np.zeros((8, 32), np.int32))
    with pytest.raises(ValueError, match="GPT: input 'tokens' is float32; the model takes int32"):
        GPT("tiny")(np.zeros((8, 16), np.float32))
    with pytest.raises(ValueError, match="GPT.loss: the batch lacks input 'targets'"):
        GPT("tiny").loss({"tokens": np.zeros((8, 16), np.int32)})
    with pytest.raises(TypeError, match="a GPTConfig or a preset's name, not int"):
        GPT(3)
    spec = TrainSpec(backend="torch", strategy="dp", mesh=(("dp", 1),), model="tiny-gpt2", steps=2, batch=8,
                     checkpoint_dir="/nonexistent")
    module = GPT("tiny")
    with pytest.raises(ValueError, match="that parlay.flax_nnx.adamw\\(config\\) did not make"):
        save_checkpoint(spec, module, nnx.Optimizer(module, optax.adam(1e-3), wrt=nnx.Param), [])
    with pytest.raises(ValueError, match=r"adamw config differs from spec.optimizer \(lr 0.01 vs 0.001\)"):
        save_checkpoint(spec, module, nnx.Optimizer(module, adamw(OptimizerConfig(lr=1e-2)), wrt=nnx.Param), [])
    placed = GPT("tiny", strategy="dp", mesh={"dp": 2}, batch=4)
    with pytest.raises(ValueError, match="placed for batches of 4 but spec.batch is 8"):
        save_checkpoint(spec, placed, nnx.Optimizer(placed, adamw(OptimizerConfig()), wrt=nnx.Param), [])
    with pytest.raises(TypeError, match="takes a parlay model as an NNX module .*not Linear.*as an NnxModel"):
        save_checkpoint(spec, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), None, [])
    with pytest.raises(ValueError, match="that parlay.flax_nnx.adamw\\(config\\) did not make"):
        load_checkpoint(module, "/nonexistent", nnx.Optimizer(module, optax.sgd(1e-3), wrt=nnx.Param))
    opt = nnx.Optimizer(module, adamw(OptimizerConfig()), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"the module's model is not spec.model 'tiny-gpt2' \(module vs spec: "
                                         r"activation 'swiglu' vs 'gelu', mlp 128 vs 256, norm 'rms' vs 'layer'\)"):
        save_checkpoint(spec, module, opt, [])
    with pytest.raises(ValueError, match="the optimizer took 0 updates but 1 losses are given"):
        save_checkpoint(dataclasses.replace(spec, model="tiny"), module, opt, [1.0])


@pytest.mark.slow
def test_an_nnx_checkpoint_loads_back_into_nnx(tmp_path):
    # Save after 2 NNX steps under fsdp+tp; a fresh module under dp on 4 devices loads it and takes
    # the uninterrupted loop's steps 3 and 4.
    from parlay.checkpoint import CheckpointError
    from parlay.training import TrainSpec

    cfg = OptimizerConfig(lr=3e-3, warmup=1)
    spec = TrainSpec(backend="jax-gspmd", strategy="fsdp+tp", mesh=(("dp", 2), ("tp", 2)), model="tiny", steps=4,
                     batch=8, optimizer=cfg, eval_batches=0, checkpoint_dir=str(tmp_path))
    from examples.nnx_gpt import train as loop

    first = GPT("tiny", strategy="fsdp+tp", mesh=dict(dp=2, tp=2), batch=8)
    full = loop(first, nnx.Optimizer(first, adamw(cfg), wrt=nnx.Param), spec, range(4), save_at=2)
    second = GPT("tiny", seed=7, strategy="dp", mesh=dict(dp=4), batch=8)
    opt = nnx.Optimizer(second, adamw(cfg), wrt=nnx.Param)
    assert load_checkpoint(second, tmp_path / "step-00000002", opt) == 2
    assert int(opt.step[...]) == 2
    np.testing.assert_allclose(loop(second, opt, spec, range(2, 4)), full[2:], rtol=1e-6)
    with pytest.raises(CheckpointError, match="the checkpoint.s parameters differ from the module.s"):
        load_checkpoint(Model(_small_gpt()), tmp_path / "step-00000002")


def _small_gpt():
    from parlay.core.models.gpt import GPT as Neutral

    return Neutral(TINY.config.with_(layers=1))


@pytest.mark.slow
def test_the_nnx_gpt_example_writes_a_checkpoint_parlay_train_resumes(tmp_path):
    # The README's example, 2 of its 8 steps; parlay train's own resume check accepts the folder
    # for the command the README gives (torch, dp+tp on dp=2,tp=2).
    from examples.nnx_gpt import main as example

    from parlay.checkpoint import Checkpoint
    from parlay.training import TrainSpec, check_resume, make_train_program

    losses = example(["--dir", str(tmp_path), "--steps", "2"])
    spec = TrainSpec(backend="torch", strategy="dp+tp", mesh=(("dp", 2), ("tp", 2)), model="tiny", steps=8, batch=8,
                     optimizer=OptimizerConfig(lr=1e-2, warmup=3, decay_steps=8), checkpoint_dir=str(tmp_path))
    ckpt = Checkpoint(tmp_path / "step-00000002")
    check_resume(ckpt, spec, make_train_program(spec))
    assert ckpt.meta("losses") == losses and ckpt.meta("backend") == "jax-nnx"
    assert ckpt.meta("strategy") == "fsdp+tp" and ckpt.meta("mesh") == {"dp": 2, "tp": 4}
