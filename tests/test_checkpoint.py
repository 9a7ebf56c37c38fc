"""Sharded checkpoints: resume across backends, strategies and meshes; a crash mid-save; bad files."""

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from parlay.checkpoint import LOCK_FILE, Checkpoint, CheckpointError, committed, latest
from parlay.cli import main

# 8 steps, the learning rate warming up over 3 and decaying to the 8th: a schedule to get right.
COMMON = ["--steps", "8", "--batch", "8", "--warmup", "3", "--lr", "1e-2", "--eval-every", "4", "--eval-batches", "2"]


def _train(tmp_path, name, *flags):
    path = tmp_path / f"{name}.json"
    assert main(["train", *COMMON, *flags, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _resume_equals_uninterrupted(tmp_path, first, second):
    """``first`` trains 8 steps saving at 4 and 8; drop the step-8 checkpoint; ``second``
    resumes at 4 and must take the uninterrupted run's steps 5..8."""
    d = tmp_path / "ckpt"
    full = _train(tmp_path, "full", *first, "--checkpoint-dir", str(d), "--checkpoint-every", "4")
    assert [p.name for p in committed(d)] == ["step-00000004", "step-00000008"]
    shutil.rmtree(d / "step-00000008")
    resumed = _train(tmp_path, "resumed", *second, "--checkpoint-dir", str(d), "--resume")
    assert resumed["losses"][:4] == full["losses"][:4]  # the history travels in the manifest
    np.testing.assert_allclose(resumed["losses"][4:], full["losses"][4:], rtol=1e-5)
    np.testing.assert_allclose([e["loss"] for e in resumed["eval"]], [e["loss"] for e in full["eval"]], rtol=1e-5)
    return d


def test_torch_checkpoint_resumes_on_jax_under_another_strategy_and_mesh(tmp_path):
    d = _resume_equals_uninterrupted(
        tmp_path,
        ["--backend", "torch", "--mesh", "dp=2,tp=2", "--strategy", "zero2+tp"],
        ["--backend", "jax", "--mode", "explicit", "--mesh", "dp=2,tp=4", "--strategy", "fsdp+tp_sp"])
    # Each distinct block was written once, by the first rank holding it: dp's replicas wrote nothing
    # of the parameters (ZeRO-2 optimizer states are sharded over dp, so every rank wrote some).
    manifest = json.loads((d / "step-00000004" / "manifest.json").read_text())
    wq = manifest["tensors"]["params/blocks.0.attn.wq"]
    assert {p["file"] for p in wq["pieces"]} == {"rank-00000.safetensors", "rank-00001.safetensors"}
    assert manifest["backend"] == "torch" and manifest["count"] == 4 and manifest["mesh"] == {"dp": 2, "tp": 2}


def test_jax_checkpoint_resumes_on_torch_under_another_strategy_and_mesh(tmp_path):
    _resume_equals_uninterrupted(
        tmp_path,
        ["--backend", "jax", "--mode", "gspmd", "--mesh", "dp=4", "--strategy", "zero1"],
        ["--backend", "torch", "--mesh", "tp=2", "--strategy", "tp_sp"])


def test_keep_last_prunes_only_older_committed_checkpoints(tmp_path):
    d = tmp_path / "ckpt"
    _train(tmp_path, "run", "--backend", "jax", "--mesh", "dp=2", "--strategy", "dp", "--checkpoint-dir", str(d),
           "--checkpoint-every", "2", "--keep-last", "2")
    names = sorted(p.name for p in d.iterdir() if p.name != LOCK_FILE)  # the lock file stays, empty
    assert names == ["step-00000006", "step-00000008"]


@pytest.mark.parametrize("stage", [pytest.param("before-manifest", marks=pytest.mark.exhaustive), "before-rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_resume_works(tmp_path, stage):
    d = tmp_path / "ckpt"
    flags = ["--backend", "jax", "--mesh", "dp=2,tp=2", "--strategy", "dp+tp"]
    argv = [sys.executable, "-m", "parlay", "train", *COMMON, *flags, "--checkpoint-dir", str(d), "--checkpoint-every", "4"]
    env = {**os.environ, "PARLAY_CHECKPOINT_CRASH": f"{stage}@8"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL, in the middle of the step-8 save
    assert (d / "step-00000008.tmp").is_dir() and latest(d).name == "step-00000004"
    assert Checkpoint(latest(d)).step == 4
    resumed = _train(tmp_path, "resumed", *flags, "--checkpoint-dir", str(d), "--resume", "--checkpoint-every", "4")
    full = _train(tmp_path, "full", *flags)
    np.testing.assert_allclose(resumed["losses"], full["losses"], rtol=1e-5)
    assert [p.name for p in committed(d)] == ["step-00000004", "step-00000008"] and not (d / "step-00000008.tmp").exists()


# -- bad files: one clear error naming the file and the field -----------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    assert main(["train", *COMMON, "--steps", "2", "--warmup", "1", "--backend", "jax", "--mesh", "tp=2", "--strategy", "tp",
                 "--checkpoint-dir", str(d), "--checkpoint-every", "2"]) == 0
    return latest(d)


@pytest.fixture
def copy(good, tmp_path):
    out = tmp_path / "step-00000002"
    shutil.copytree(good, out)
    return out


def _edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _error(path, read="params/embed.table", **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path).read(read, **kw)
    return str(e.value)


def test_a_good_checkpoint_reads_any_region(good):
    c = Checkpoint(good)
    whole = c.read("params/blocks.0.mlp.w_in")
    assert whole.shape == (64, 128) and whole.dtype == np.float32
    np.testing.assert_array_equal(c.read("params/blocks.0.mlp.w_in", (slice(3, 40), slice(50, 90))), whole[3:40, 50:90])


def test_truncated_tensor_file(copy):
    f = copy / "rank-00000.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])  # the header intact, the tensors cut
    assert _error(copy) == (f"{f}: not a readable safetensors file (Error while deserializing header: incomplete "
                            f"metadata, file not fully covered)")


def test_corrupted_tensor_bytes(copy):
    """Bytes changed inside a block (not its header): the block's SHA-256 catches it."""
    f = copy / "rank-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-5000:-4000] = bytes(1000)
    f.write_bytes(bytes(data))
    c = Checkpoint(copy)
    bad = [name for name in c.tensors if _fails(c, name)]
    assert bad, "no tensor noticed the corruption"
    with pytest.raises(CheckpointError, match=r"rank-00000.safetensors: tensor '.*' does not match the manifest's SHA-256 \(the file is corrupted or from another checkpoint\)"):
        c.read(bad[0])


def _fails(c, name) -> bool:
    try:
        c.read(name)
    except CheckpointError:
        return True
    return False


def test_malformed_manifest(copy):
    (copy / "manifest.json").write_text('{"format": "parlay-checkpoint", "version": 1,')
    assert _error(copy) == f"{copy}/manifest.json: not valid JSON (Expecting property name enclosed in double quotes at line 1, column 46)"


def test_wrongly_typed_field(copy):
    _edit_manifest(copy, lambda m: m.update(step="four"))
    assert _error(copy) == f"{copy}/manifest.json: field 'step' must be an integer, not 'four'"
    _edit_manifest(copy, lambda m: m.update(step=2) or m["tensors"]["params/embed.table"].update(shape="256,64"))
    assert _error(copy) == (f"{copy}/manifest.json: tensor 'params/embed.table': field 'shape' must be a list of "
                            f"non-negative ints, not '256,64'")


def test_shape_mismatches(copy):
    assert _error(copy, shape=(512, 64)) == (f"{copy}/manifest.json: tensor 'params/embed.table' has shape (256, 64); "
                                             f"the model expects (512, 64)")
    _edit_manifest(copy, lambda m: m["tensors"]["params/embed.table"].update(shape=[256, 32]))
    assert "tensor 'params/embed.table', piece 0: the block (0, 0)..(128, 64) is empty or outside the shape (256, 32)" in _error(copy)
    # A tensor file whose block has another shape than its manifest entry says.
    _edit_manifest(copy, lambda m: m["tensors"]["params/embed.table"].update(shape=[256, 64]))
    from safetensors.numpy import load_file, save_file

    f = copy / "rank-00000.safetensors"
    from safetensors import safe_open

    blocks = load_file(str(f))
    with safe_open(str(f), framework="numpy") as h:
        header = h.metadata()  # the stamp kept: the file is this checkpoint's, its block is not
    blocks["params/embed.table@0,0"] = np.zeros((128, 32), np.float32)
    save_file(blocks, str(f), metadata=header)
    assert _error(copy) == (f"{f}: tensor 'params/embed.table@0,0' is F32 [128, 32]; the manifest says F32 [128, 64]")


def test_hostile_files_run_no_code(copy, tmp_path):
    # A piece pointing outside the folder.
    _edit_manifest(copy, lambda m: m["tensors"]["params/embed.table"]["pieces"][0].update(file="../../etc/passwd"))
    assert _error(copy) == (f"{copy}/manifest.json: tensor 'params/embed.table', piece 0: field 'file' is "
                            f"'../../etc/passwd'; pieces live in rank-NNNNN.safetensors files inside the checkpoint folder")
    _edit_manifest(copy, lambda m: m["tensors"]["params/embed.table"]["pieces"][0].update(file="rank-00000.safetensors"))
    # A pickle posing as a tensor file: were it unpickled, it would create `marker`.
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    f = copy / "rank-00000.safetensors"
    f.write_bytes(pickle.dumps(Payload()))
    assert _error(copy).startswith(f"{f}: not a readable safetensors file (")
    assert not marker.exists()
    # A header that claims 2**40 bytes of metadata.
    f.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    assert _error(copy).startswith(f"{f}: not a readable safetensors file (")
    # Pieces that overlap (and leave a gap): refused before any read.
    def overlap(m):
        pieces = m["tensors"]["params/embed.table"]["pieces"]
        pieces[1].update(start=[0, 0], stop=[128, 64])
    _edit_manifest(copy, overlap)
    assert _error(copy) == f"{copy}/manifest.json: tensor 'params/embed.table': its pieces do not tile the shape (256, 64) exactly once"


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="manifest.json: missing; .* is not a committed parlay checkpoint"):
        Checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "safetensors", "version": 1}')
    with pytest.raises(CheckpointError, match="field 'format' is 'safetensors'; a parlay checkpoint says 'parlay-checkpoint'"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("flags, message", [
    (["--resume"], "parlay: --checkpoint-every and --resume need --checkpoint-dir DIR"),
    (["--resume", "--checkpoint-dir", "/no/such/dir"], "parlay: --resume: '/no/such/dir' holds no committed checkpoint"),
])
def test_bad_resume_flags(flags, message, capsys):
    assert main(["train", "--backend", "jax", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_resume_with_another_model_or_seed_is_refused(good, tmp_path, capsys):
    d = tmp_path / "c"
    shutil.copytree(good, d / good.name)
    base = ["train", *COMMON, "--warmup", "1", "--backend", "jax", "--mesh", "tp=2", "--strategy", "tp",
            "--checkpoint-dir", str(d), "--resume"]
    assert main([*base, "--model", "tiny-gqa"]) == 2
    assert "field 'model' differs from --model tiny-gqa: kv_heads 8 vs 4" in capsys.readouterr().err
    assert main([*base, "--steps", "9"]) == 2
    assert "field 'optimizer' differs from this run's: decay_steps 2 vs 9 (the cosine schedule ends" in capsys.readouterr().err
    assert main([*base, "--steps", "2"]) == 2
    assert "the checkpoint is already at step 2 and --steps is 2: nothing left to train" in capsys.readouterr().err
    assert main([*base, "--seed", "1"]) == 2
    assert "resume with the same --seed, --batch and --data" in capsys.readouterr().err


def test_a_checkpoint_exports_to_a_hugging_face_folder_and_back(good, tmp_path):
    """tiny's rotary + RMSNorm + SwiGLU is a LLaMA: checkpoint -> HF folder -> checkpoint is exact."""
    from transformers import LlamaForCausalLM

    from parlay.hf import checkpoint_to_hf, hf_to_checkpoint

    folder = checkpoint_to_hf(good, tmp_path / "hf")
    assert isinstance(LlamaForCausalLM.from_pretrained(folder), LlamaForCausalLM)
    back = Checkpoint(hf_to_checkpoint(folder, tmp_path / "again", step=2))
    src = Checkpoint(good)
    for name in [n for n in src.tensors if n.startswith("params/")]:
        np.testing.assert_array_equal(back.read(name), src.read(name))
    for key in ("describe", "params"):
        assert back.meta("model")[key] == src.meta("model")[key]
    assert back.meta("count") == 0


def test_init_from_an_imported_hugging_face_checkpoint(good, tmp_path):
    """export-hf, import-hf, then train --init-from: the same steps as starting from the original
    checkpoint's parameters (fresh optimizer), and not those of a fresh initialisation."""
    out = tmp_path / "hf"
    assert main(["export-hf", str(good), str(out)]) == 0
    assert main(["import-hf", str(out), str(tmp_path / "imported")]) == 0
    flags = ["--backend", "jax", "--mesh", "dp=2", "--strategy", "dp", "--steps", "3", "--warmup", "0"]
    from_hf = _train(tmp_path, "a", *flags, "--init-from", str(tmp_path / "imported" / "step-00000000"))
    direct = _train(tmp_path, "b", *flags, "--init-from", str(good))
    on_torch = _train(tmp_path, "t", *flags, "--backend", "torch", "--init-from", str(good))
    fresh = _train(tmp_path, "c", *flags)
    assert from_hf["losses"] == direct["losses"] and from_hf["init_from"].endswith("step-00000000")
    np.testing.assert_allclose(on_torch["losses"], direct["losses"], rtol=1e-5)
    assert abs(from_hf["losses"][0] - fresh["losses"][0]) > 1e-3


def test_pruning_keeps_newer_steps_and_a_new_run_refuses_a_used_folder(good, tmp_path, capsys):
    from parlay import checkpoint

    d = tmp_path / "c"
    c = Checkpoint(good)
    meta = {k: v for k, v in c.manifest.items() if k not in ("format", "version", "step", "tensors", "run")}
    meta.update(count=0, losses=[], evals=[])  # parameters only: any step may hold them
    tensors = [(n, e.shape, e.layout, e.pieces) for n, e in c.tensors.items()]
    blocks = {}
    for e in c.tensors.values():
        for p in e.pieces:
            blocks.setdefault(p.file, {})[p.key] = c.read(e.name, tuple(slice(a, b) for a, b in zip(p.start, p.stop)))
    checkpoint.save(d, 300, tensors, blocks, meta)
    checkpoint.save(d, 100, tensors, blocks, meta, keep_last=1)  # an older step than one already there
    assert [p.name for p in committed(d)] == ["step-00000100", "step-00000300"]
    assert main(["train", "--backend", "jax", "--mesh", "tp=2", "--strategy", "tp", "--checkpoint-dir", str(d),
                 "--checkpoint-every", "2"]) == 2
    assert "already holds checkpoints of a run (newest step-00000300); --resume it, or give a new folder" in capsys.readouterr().err


def test_reading_outside_the_tensor_is_refused(good):
    c = Checkpoint(good)
    with pytest.raises(ValueError, match=r"region .* is not a non-empty box inside the shape \(256, 64\)"):
        c.read("params/embed.table", (slice(250, 260), slice(0, 64)))
    with pytest.raises(ValueError, match="1 slices for a tensor of 2 dims"):
        c.read("params/embed.table", (slice(0, 4),))


def test_a_pipelined_torch_checkpoint_resumes_without_pp_and_the_reverse(tmp_path):
    # pp=2 x dp=2, 1F1B on 2 microbatches: each pp rank writes only its stages' parameters.
    d = _resume_equals_uninterrupted(
        tmp_path / "a",
        ["--backend", "torch", "--mesh", "pp=2,dp=2", "--strategy", "pp+dp", "--microbatches", "2"],
        ["--backend", "numpy", "--mesh", "dp=2,tp=2", "--strategy", "fsdp+tp"])
    manifest = json.loads((d / "step-00000004" / "manifest.json").read_text())
    files = lambda name: {p["file"] for p in manifest["tensors"][name]["pieces"]}
    assert files("params/embed.table") == {"rank-00000.safetensors"}  # pp rank 0: ranks 0 and 1
    assert files("params/lm_head.w") == {"rank-00002.safetensors"}  # pp rank 1: ranks 2 and 3
    _resume_equals_uninterrupted(
        tmp_path / "b",
        ["--backend", "numpy", "--mesh", "dp=2", "--strategy", "zero2"],
        ["--backend", "torch", "--mesh", "pp=2,dp=2", "--strategy", "pp+zero2", "--microbatches", "2",
         "--schedule", "zb-h1"])


@pytest.mark.slow
def test_a_pipelined_jax_checkpoint_resumes_without_pp_and_the_reverse(tmp_path):
    # The tick loop holds its stages' parameters stacked over pp; the checkpoint holds them by name.
    _resume_equals_uninterrupted(
        tmp_path / "a",
        ["--backend", "jax", "--mesh", "pp=2,dp=2,tp=2", "--strategy", "pp+dp+tp", "--microbatches", "2"],
        ["--backend", "jax", "--mesh", "dp=2,tp=2", "--strategy", "zero2+tp"])
    _resume_equals_uninterrupted(
        tmp_path / "b",
        ["--backend", "jax", "--mesh", "dp=4", "--strategy", "fsdp"],
        ["--backend", "jax", "--mesh", "pp=2,dp=2", "--strategy", "pp+zero2", "--microbatches", "4",
         "--schedule", "zb-h1"])
