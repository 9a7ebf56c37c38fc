"""The README's own model (the MLP of "Bring your own model and strategy") runs as written."""

from pathlib import Path

from parlay.cli import main

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_mlp_compares_and_steps(tmp_path, capsys):
    text = README.read_text()
    start = text.index("# mlp.py: a classifier")
    (tmp_path / "mlp.py").write_text(text[start:text.index("```", start)])
    ref = ["--model", f"{tmp_path / 'mlp.py'}:model", "--strategy", f"{tmp_path / 'mlp.py'}:TP", "--mesh", "dp=2,tp=2"]
    assert main(["compare", *ref, "--steps", "2", "--backends", "numpy,jax", "--plot", ""]) == 0
    assert main(["train", *ref, "--backend", "numpy", "--steps", "30", "--warmup", "5", "--eval-every", "30"]) == 0
    assert "held-out loss" in capsys.readouterr().out
