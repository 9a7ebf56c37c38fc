"""Programs: every layout resolved and checked once, every problem reported (with the message pinned)."""

import pickle
import textwrap

import pytest

from parlay import Mesh, Rules
from parlay.core.layers import ParamDecl
from parlay.core.loading import load_model, load_strategy
from parlay.core.model import DType, InputDecl
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import ProgramError, make_program
from parlay.core.strategies import Role, Strategy

TINY = GPT(PRESETS["tiny-gqa"])


@pytest.mark.parametrize("strategy, mesh, match", [
    ("tp", Mesh(dp=4), r"strategy 'tp' uses mesh axes \['tp'\] but Mesh\(dp=4\) lacks \['tp'\]; e.g. --mesh tp=2"),
    ("tp", Mesh(tp=3), r"logical dim 'heads' has size 8, not divisible by 3 \(tp=3\), where strategy 'tp' shards it "
                       r"\(params, compute, grads, optimizer, activations: 'blocks.0.attn.wq' dim 1"),
    ("dp+tp", Mesh(dp=3, tp=2), r"logical dim 'batch' has size 8, not divisible by 3 \(dp=3\).*input 'tokens' dim 0"),
    ("ulysses", Mesh(sp=8), r"logical dim 'kv_heads' has size 4, not divisible by 8 \(sp=8\)"),
    ("tp", Mesh(dp=2, tp=2), r"mesh axis 'dp' \(size 2\) shards no tensor under strategy 'tp', so every rank along "
                             r"it would compute the same thing; the model's batch dim is named \['batch'\]"),
])
def test_a_strategy_that_cannot_apply_says_every_reason(strategy, mesh, match):
    with pytest.raises(ProgramError, match=match):
        make_program(TINY, strategy, mesh, batch=8)


def test_every_problem_is_its_own_bullet():
    with pytest.raises(ProgramError) as e:
        make_program(TINY, "tp", Mesh(tp=3), batch=8)
    assert len(e.value.problems) == 4  # vocab, heads, kv_heads, mlp: one bullet each, every role in it
    assert str(e.value).count("\n  - ") == 4


def test_a_rule_that_matches_no_tensor_is_an_error():
    typo = Strategy("mine", params=Rules([("mpl", "tp")]), activations=Rules([("batch", "dp")]))
    with pytest.raises(ProgramError) as e:
        make_program(TINY, typo, Mesh(dp=2, tp=2), batch=8)
    assert e.value.problems == (
        "rule ('mpl', 'tp') of strategy 'mine' (params, compute, optimizer, grads) matches no tensor: no parameter "
        "has a dim named 'mpl'; the parameter dims are ['embed', 'heads', 'kv', 'kv_heads', 'mlp', 'vocab']; fix the "
        "name or drop the rule",
        "mesh axis 'tp' (size 2) shards no tensor under strategy 'mine', so every rank along it would compute the same "
        "thing; its rules ('mpl', 'tp') match no dim of the model; map a dim of a parameter, an input or a constraint "
        "point to it, or drop the axis")
    # Built-in strategies are templates: tp's 'vocab' rule is fine on a model without a vocabulary.
    assert "vocab" in load_strategy("tp").generic
    # A rule per role: 'feat' is a parameter dim, but no activation is named so (no constraint point).
    act = Strategy("act", activations=[("batch", "dp"), ("feat", "tp")])
    with pytest.raises(ProgramError, match=r"rule \('feat', 'tp'\) of strategy 'act' \(activations\) matches no tensor: "
                                           r"no input or constraint point \(ops.constrain\) has a dim named 'feat'"):
        make_program(_Classifier(input_dims=("batch", None)), act, Mesh(dp=2, tp=2), batch=4)


def test_a_model_whose_batch_dim_no_rule_shards():
    """The model calls its batch dim 'images': dp's rule for 'batch' matches nothing, dp idles."""
    model = _Classifier(batch_dim="images")
    with pytest.raises(ProgramError, match=r"mesh axis 'dp' \(size 2\) shards no tensor .* the model's batch dim is "
                                           r"named \['images'\]: map it to 'dp' \(a rule \('images', 'dp'\)\)"):
        make_program(model, "dp", Mesh(dp=2), batch=4)
    mine = Strategy("data", activations=Rules([("images", "dp")]))
    program = make_program(model, mine, Mesh(dp=2), batch=4)
    assert str(program.layouts[Role.ACTIVATIONS]["x"].spec) == "[dp]"


def test_model_mistakes_are_listed():
    with pytest.raises(ProgramError, match=r"the loss has shape \(4,\); loss\(ops, params, batch\) must return a scalar"):
        make_program(_Classifier(reduce=False), "dp", Mesh(dp=1), batch=4)
    with pytest.raises(ProgramError, match=r"parameter 'w' is declared with dims \('feat', 'cls'\) but used with "
                                           r"\('cls', 'feat'\)"):
        make_program(_Classifier(swap_dims=True), "dp", Mesh(dp=1), batch=4)
    with pytest.raises(ValueError, match=r"einsum 'bf,fc->bc': letter 'f' has size 5 and 6"):
        make_program(_Classifier(features=5), "dp", Mesh(dp=1), batch=4)


def test_programs_pickle_and_keep_their_layouts():
    p = make_program(TINY, "fsdp+tp", Mesh(dp=2, tp=2), batch=8)
    q = pickle.loads(pickle.dumps(p))
    assert q.layouts == p.layouts and q.activations == p.activations and q.model == p.model


def test_a_model_from_a_file_rebuilds_from_its_reference(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent('''
        from parlay.core.models.gpt import GPT, PRESETS
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class Mine(GPT):
            pass

        def make():
            return Mine(PRESETS["tiny"])
    '''))
    model, ref = load_model(f"{path}:make")
    assert ref == f"{path}:make" and type(model).__name__ == "Mine"
    p = make_program(model, "dp", Mesh(dp=2), batch=8, model_ref=ref)
    state = p.__getstate__()
    assert state["model"] is None  # a class from a file travels as its reference
    q = pickle.loads(pickle.dumps(p))
    assert type(q.model).__name__ == "Mine" and q.shapes == p.shapes


@pytest.mark.parametrize("ref, match", [
    ("nope", r"model 'nope' is not a preset \(tiny, tiny-gqa"),
    ("missing.py:m", r"model 'missing.py:m': 'missing.py' is not a file"),
    ("parlay.core.models.gpt:NOPE", r"'parlay.core.models.gpt' has no 'NOPE' \(it defines"),
    ("parlay.core.models.gpt:PRESETS", r"model 'parlay.core.models.gpt:PRESETS' is dict, which lacks decls\(\)"),
    ("json:dumps", r"model 'json:dumps': dumps is a function of \(obj\); give a model object or a function of no"),
])
def test_bad_model_references(ref, match):
    with pytest.raises((ValueError, TypeError), match=match):
        load_model(ref)


def test_bad_strategy_references():
    with pytest.raises(TypeError, match=r"strategy 'parlay.core.models.gpt:PRESETS' is a dict, not a parlay Strategy"):
        load_strategy("parlay.core.models.gpt:PRESETS")
    combined = load_strategy("dp+tests.core.test_program:TP_ONLY")
    assert combined.name == "dp+tp_only"


TP_ONLY = Strategy("tp_only", params=Rules([("heads", "tp")]))


class _Classifier:
    """x (B, 6) -> logits (B, 3), a cross entropy: small enough to get each mistake in isolation."""

    def __init__(self, *, batch_dim="batch", reduce=True, swap_dims=False, features=6, input_dims=None):
        self.batch_dim, self.reduce, self.swap, self.features = batch_dim, reduce, swap_dims, features
        self.input_dims = input_dims or (batch_dim, "feat")

    def decls(self):
        return (ParamDecl("w", (6, 3), ("feat", "cls")),)

    def inputs(self, batch):
        return {"x": InputDecl((batch, self.features), self.input_dims, DType.FLOAT32),
                "y": InputDecl((batch,), (self.batch_dim,), DType.INT32, high=3)}

    def loss(self, ops, params, batch):
        w = ops.param("w", params["w"], ("cls", "feat") if self.swap else ("feat", "cls"))
        logits = ops.einsum("bf,fc->bc", batch["x"], w)
        return ops.cross_entropy(logits, batch["y"]) if self.reduce else ops.sum(logits, 1)
