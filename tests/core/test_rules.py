import pytest

from parlay import Layout, Mesh, P, RuleError, Rules

MESH = Mesh(dp=2, tp=4)
TP = Rules([("batch", "dp"), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"), ("embed", None)])


def test_resolve_maps_logical_names_in_order():
    assert TP.resolve(("batch", "seq", "embed"), MESH) == P("dp", None, None)
    assert TP.resolve(("embed", "mlp"), MESH) == P(None, "tp")
    assert TP.resolve((None, "heads"), MESH) == P(None, "tp")
    assert TP.layout(("mlp", "embed"), MESH) == Layout(MESH, P("tp", None))


def test_multi_axis_rule_and_fallback():
    rules = Rules([("batch", ("dp", "tp")), ("mlp", "tp"), ("mlp", None)])
    # batch takes dp and tp; mlp's first rule clashes, its explicit fallback replicates.
    assert rules.resolve(("batch", "mlp"), MESH) == P(("dp", "tp"), None)
    

def test_first_rule_wins_then_fallback():
    rules = Rules([("embed", "tp"), ("embed", "dp")])
    assert rules.resolve(("embed",), MESH) == P("tp")
    assert rules.resolve(("embed", "embed"), MESH) == P("tp", "dp")


def test_rules_are_values():
    assert Rules({"batch": "dp"}) == Rules([("batch", "dp")])
    assert eval(repr(TP)) == TP
    assert (Rules([("a", "dp")]) + Rules([("b", "tp")])).rules == (("a", ("dp",)), ("b", ("tp",)))
    assert TP.axes == ("dp", "tp")


def test_axis_used_twice_lists_every_offending_tensor():
    tensors = {
        "w_qkv": ("embed", "heads"),
        "w_mix": ("heads", "mlp"),  # heads and mlp both -> tp
        "w_out": ("mlp", "vocab"),  # mlp and vocab both -> tp
        "x": ("batch", "seq"),
    }
    with pytest.raises(RuleError) as info:
        TP.resolve_all(tensors, MESH)
    msg = str(info.value)
    assert "for 2 tensor(s)" in msg
    assert "'w_mix' dim 1 ('mlp'): every rule for 'mlp'" in msg and "'tp' by dim 0 ('heads')" in msg
    assert "'w_out' dim 1 ('vocab'): every rule for 'vocab'" in msg
    assert "Add a fallback rule ('vocab', None)" in msg
    assert len(info.value.problems) == 2


def test_missing_axis_lists_every_offending_tensor():
    with pytest.raises(RuleError) as info:
        TP.resolve_all({"a": ("batch", "mlp"), "b": ("heads",), "c": ("embed",)}, Mesh(dp=2))
    msg = str(info.value)
    assert "'a' dim 1 ('mlp'): a rule maps 'mlp' to axis 'tp', which Mesh(dp=2) lacks" in msg
    assert "'b' dim 0 ('heads')" in msg and "'c'" not in msg
    assert "for 2 tensor(s)" in msg


def test_resolve_all_checks_shapes_too():
    with pytest.raises(RuleError, match=r"'w' \('embed', 'mlp'\): dim 1 of shape \(8, 6\) has size 6, not divisible by 4"):
        TP.resolve_all({"w": ("embed", "mlp")}, MESH, shapes={"w": (8, 6)})
    with pytest.raises(RuleError, match=r"'w': 2 logical dims \('embed', 'mlp'\) but shape \(8,\)"):
        TP.resolve_all({"w": ("embed", "mlp")}, MESH, shapes={"w": (8,)})
    out = TP.resolve_all({"w": ("embed", "mlp")}, MESH, shapes={"w": (8, 16)})
    assert out == {"w": Layout(MESH, P(None, "tp"))}


def test_a_bare_string_is_not_a_list_of_dims():
    with pytest.raises(TypeError, match=r"logical dims must be a tuple of names .* for one dim write \('batch',\)"):
        TP.resolve("batch", MESH)


def test_single_resolve_error():
    with pytest.raises(RuleError, match=r"rules do not fit Mesh\(dp=2, tp=4\) for 1 tensor:\n  - 'w' dim 1"):
        TP.resolve(("heads", "mlp"), MESH, name="w")


@pytest.mark.parametrize("rules, err, match", [
    ([("a", 3)], TypeError, r"rule 'a' -> 3: a rule maps a logical dim name to None, a mesh axis"),
    ([("a", ("dp", "dp"))], ValueError, r"rule 'a' -> \('dp', 'dp'\) lists a mesh axis twice"),
    (["a"], TypeError, r"a rule is a \(logical name, mesh axes\) pair, got 'a'"),
])
def test_bad_rules(rules, err, match):
    with pytest.raises(err, match=match):
        Rules(rules)


def test_rule_errors_pickle():
    import pickle

    from parlay.core.rules import RuleError

    e = pickle.loads(pickle.dumps(RuleError("rules do not fit", ["a", "b"])))
    assert isinstance(e, RuleError) and e.problems == ("a", "b") and str(e) == "rules do not fit\n  - a\n  - b"
