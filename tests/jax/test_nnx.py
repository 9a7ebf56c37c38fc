"""Flax NNX interop (backends/jax/nnx.py): an NNX model annotated with logical dim names runs
under parlay's strategies in GSPMD mode and equals one device; Flax's logical-axis rule lists
convert to parlay ``Rules`` and back, and resolve as Flax resolves them (except where Flax
silently replicates a dim whose every rule conflicts: parlay says so)."""

import numpy as np
import pytest

from parlay.backends.jax.nnx import NnxModel, rules_from_flax, rules_to_flax, strategy_to_flax
from parlay.core import DType, InputDecl, Mesh, P, ProgramError, RuleError, Rules, get_backend, make_program
from parlay.core.loading import load_model, load_strategy

# The Flax guide's rules ("Scale up Flax Modules on multiple devices"), and MaxText's defaults
# (MaxText/configs/base.yml, google/maxtext at 01c78bbf): mesh axes data, fsdp, fsdp_transpose,
# sequence, tensor, autoregressive.
FLAX_GUIDE = [("batch", "data"), ("hidden", "model")]
MAXTEXT = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose"]],
    ["activation_heads", ["tensor", "sequence"]],
    ["activation_length", "sequence"],
    ["activation_embed", "tensor"],
    ["activation_mlp", "tensor"],
    ["activation_kv", "tensor"],
    ["activation_vocab", ["tensor", "sequence"]],
    ["activation_vocab", "tensor"],
    ["activation_vocab", "sequence"],
    ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
    ["vocab", ["tensor", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence"]],
    ["embed", ["fsdp", "sequence"]],
    ["heads", ["tensor", "autoregressive"]],
    ["kv", []],
    ["cache_batch", []],
    ["cache_heads", ["autoregressive"]],
    ["cache_kv", []],
    ["cache_sequence", []],
]
MAXTEXT_MESH = Mesh(data=2, fsdp=2, fsdp_transpose=2, sequence=2, tensor=2, autoregressive=2)
# MaxText's own tensors (parameters and activations of its decoder layer)
MAXTEXT_TENSORS = [("embed", "heads", "kv"), ("heads", "kv", "embed"), ("vocab", "embed"), ("embed", "vocab"),
                   ("activation_batch", "activation_length", "activation_embed"),
                   ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
                   ("activation_batch", "activation_length", "activation_mlp"),
                   ("activation_batch", "activation_length", "activation_vocab"),
                   ("cache_batch", "cache_sequence", "cache_heads", "cache_kv"), ("embed",), ("mlp",),
                   ("embed", "mlp"), ("mlp", "embed")]


def _normal(rules):
    """A Flax rule list as rules_to_flax writes it: one axis a name, several a tuple, none None."""
    out = []
    for name, axes in rules:
        axes = [axes] if isinstance(axes, str) else list(axes or [])
        out.append((name, None if not axes else axes[0] if len(axes) == 1 else tuple(axes)))
    return out


@pytest.mark.parametrize("rules, mesh", [(FLAX_GUIDE, Mesh(data=2, model=2)), (MAXTEXT, MAXTEXT_MESH)],
                         ids=["flax-guide", "maxtext"])
def test_flax_rules_round_trip_and_resolve_as_flax_does(rules, mesh):
    import flax.linen as nn

    parlay_rules = rules_from_flax(rules)
    assert rules_to_flax(parlay_rules) == _normal(rules)
    assert rules_from_flax(rules_to_flax(parlay_rules)) == parlay_rules
    tensors = MAXTEXT_TENSORS if rules is MAXTEXT else [("batch", "hidden"), ("hidden", "batch"), ("batch",)]
    flax_rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in rules]
    checked, refused = 0, []
    for dims in tensors:
        want = tuple(nn.logical_to_mesh_axes(dims, flax_rules))
        spec, problems = parlay_rules._resolve("t", dims, mesh)
        if spec is None:
            # parlay refuses where every rule of a dim conflicts; Flax replicates that dim silently
            assert problems and any(a is None for a in want), (dims, want, problems)
            refused.append(dims)
            continue
        got = tuple(None if e is None else e if isinstance(e, str) else tuple(e) for e in spec)
        got += (None,) * (len(dims) - len(got))
        want = tuple(None if e is None else e if isinstance(e, str) else (e[0] if len(e) == 1 else tuple(e))
                     for e in want)
        assert got == want, (dims, got, want)
        checked += 1
    assert checked >= 2
    if rules is MAXTEXT:
        # Flax goes rule by rule: 'mlp' (listed first) takes fsdp_transpose, so embed falls to its
        # second rule. Resolving dim by dim (parlay's own order) would give embed its first rule and
        # leave mlp none: the lists read from Flax keep Flax's order.
        assert parlay_rules.flax_order and checked == len(MAXTEXT_TENSORS) - 1
        # attention's activations: activation_heads (listed before activation_length) takes sequence
        # and tensor, leaving the length and kv dims no rule; Flax replicates them without a word
        assert refused == [("activation_batch", "activation_length", "activation_heads", "activation_kv")]
        assert parlay_rules.resolve(("embed", "mlp"), mesh) == P(("fsdp", "sequence"),
                                                                 ("fsdp_transpose", "tensor", "autoregressive"))
        dim_order = Rules(parlay_rules.rules)
        assert dim_order._resolve("w", ("embed", "mlp"), mesh)[0] is None


def test_a_strategy_flax_cannot_say_is_listed():
    assert strategy_to_flax(load_strategy("dp+tp")) == [("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"),
                                                        ("vocab", "tp"), ("batch", "dp")]
    with pytest.raises(RuleError, match=r"strategy 'fsdp' places these logical names differently per role.*\n  - "
                                        r"'embed': params over dp; compute whole; grads over dp; optimizer over dp"):
        strategy_to_flax(load_strategy("fsdp"))
    with pytest.raises(RuleError, match=r"rule 0: \('batch',\) is not a \(logical name, mesh axes\) pair"):
        rules_from_flax([("batch",)])


MODEL, _ = load_model("examples/nnx_mlp.py:model")


def _loss_and_grads(session, batch):
    return session.loss_and_grads(batch)


def _batch(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 64)).astype(np.float32), "y": rng.integers(0, 10, n).astype(np.int32)}


def test_parlay_runs_the_module_as_nnx_does():
    # One device: parlay's loss and gradients are nnx.value_and_grad's on the same module and batch.
    import jax.numpy as jnp
    from flax import nnx

    from examples.nnx_mlp import Classifier, loss

    program = make_program(MODEL, "dp", Mesh(dp=1), batch=8)
    got_loss, got = get_backend("jax-single").run(program, _loss_and_grads, _batch())
    with nnx.use_eager_sharding(False):
        module = Classifier(nnx.Rngs(0))
    value, grads = nnx.value_and_grad(loss)(module, {k: jnp.asarray(v) for k, v in _batch().items()})
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert set(flat) == set(got) and len(got) == 2 + 6 * 2  # stem, head; per block a norm's 2 and 2 linears' 4
    assert abs(got_loss - float(value)) <= 1e-6 * abs(float(value))
    for k in flat:
        np.testing.assert_allclose(got[k], flat[k], rtol=0, atol=1e-6 * np.abs(flat[k]).max(), err_msg=k)
    dims = {d.name: d.dims for d in MODEL.decls()}
    assert dims["blocks.0.w_in.kernel"] == ("embed", "mlp") and dims["stem.kernel"] == ("features", "embed")


CASES = [pytest.param("dp", dict(dp=4), id="dp"),
         pytest.param("fsdp", dict(dp=8), id="fsdp", marks=pytest.mark.exhaustive),
         pytest.param("tp", dict(tp=4), id="tp", marks=pytest.mark.exhaustive),
         pytest.param("fsdp+tp", dict(dp=2, tp=4), id="fsdp+tp"),
         pytest.param("examples/nnx_mlp.py:FLAX_TP", dict(dp=2, tp=4), id="FLAX_TP")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, axes", CASES)
def test_the_nnx_example_equals_one_device_under_parlay_strategies(strategy, axes):
    from parlay.compare import run_compare

    program = make_program(MODEL, load_strategy(strategy), Mesh(**axes), batch=16)
    ref, (run,) = run_compare(program, steps=5, backends=("jax-gspmd",), bisect=False)
    assert run.agree, (run.loss_diff, run.grad_diff, run.param_diff)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)


def test_what_an_nnx_model_cannot_run_is_refused(capsys):
    from flax import nnx

    from parlay.cli import main

    class WithStats(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.BatchNorm(4, rngs=rngs)

    with pytest.raises(ValueError, match=r"WithStats holds state that is not an nnx.Param \(norm.mean, norm.var\)"):
        NnxModel(WithStats, lambda m, b: 0.0, lambda n: {"x": InputDecl((n, 4), ("batch", None), DType.FLOAT32)})
    assert main(["compare", "--model", "examples/nnx_mlp.py:model", "--mesh", "dp=2", "--strategy", "dp"]) == 2
    assert "runs on jax-single, jax-gspmd only, not torch, jax, numpy: use --backend jax --mode gspmd" in \
        capsys.readouterr().err
    program = make_program(MODEL, "dp", Mesh(dp=2), batch=8)
    with pytest.raises(ValueError, match=r"Flax NNX model: it runs on JAX's global arrays .*not on Sharded blocks"):
        get_backend("jax").run(program, _loss_and_grads, _batch())
    with pytest.raises(ProgramError, match="no parameter has a dim named 'mpl'"):
        from parlay.core import Rules, Strategy

        make_program(MODEL, Strategy("typo", params=Rules([("mpl", "tp")])), Mesh(tp=2), batch=8)


@pytest.mark.slow
def test_the_nnx_example_trains_sharded_and_resumes_under_another_strategy(tmp_path):
    # 8 steps of fsdp+tp on dp=2,tp=2 saving at 4 and 8; drop step 8; dp on dp=4 resumes at 4 and
    # takes the uninterrupted run's steps 5..8 (parameters and AdamW moments by their NNX paths).
    import json
    import shutil

    from parlay.checkpoint import committed
    from parlay.cli import main

    common = ["train", "--model", "examples/nnx_mlp.py:model", "--backend", "jax", "--mode", "gspmd", "--steps", "8",
              "--batch", "16", "--warmup", "2", "--lr", "3e-3", "--eval-every", "4", "--eval-batches", "2",
              "--checkpoint-dir", str(tmp_path / "ckpt")]

    def train(name, *flags):
        assert main([*common, *flags, "--json", str(tmp_path / f"{name}.json")]) == 0
        return json.loads((tmp_path / f"{name}.json").read_text())

    full = train("full", "--strategy", "fsdp+tp", "--mesh", "dp=2,tp=2", "--checkpoint-every", "4")
    assert [p.name for p in committed(tmp_path / "ckpt")] == ["step-00000004", "step-00000008"]
    shutil.rmtree(tmp_path / "ckpt" / "step-00000008")
    resumed = train("resumed", "--strategy", "dp", "--mesh", "dp=4", "--resume")
    np.testing.assert_allclose(resumed["losses"][4:], full["losses"][4:], rtol=1e-5)
    assert full["losses"][-1] < full["losses"][0]
