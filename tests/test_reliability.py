"""Fault injection: runs that never hang, never orphan a rank, never lose or accept a wrong checkpoint.

Each fault happens to a real ``parlay train`` in a subprocess with a 5-second collective timeout:
a rank stopped (SIGSTOP) or killed, the launcher killed or sent SIGTERM/SIGINT, a second run on the
same folder, and checkpoints tampered with. Every test asserts one clear line, a bounded exit time,
no surviving rank and the last committed checkpoint intact (and, where it matters, resumable).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parlay import checkpoint
from parlay.checkpoint import Checkpoint, CheckpointError, FolderLocked, latest, locked
from parlay.cli import main

TIMEOUT = 5  # --collective-timeout of the faulted runs
# No cosine decay and no warmup: a resumed run may stop at any --steps.
FLAGS = ["--mesh", "dp=2", "--strategy", "dp", "--batch", "4", "--eval-batches", "0", "--no-cosine", "--warmup", "0"]


# -- processes --------------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped or defunct process has stopped for good)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ranks(pid: int) -> list[int]:
    """The rank processes a launcher started, in rank order (they start in order)."""
    ranks = [c for c in _children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(ranks)


def _start_train(ck: Path, *extra, steps=100000, every=2):
    """A torch ``parlay train`` saving every ``every`` steps; returns once it committed one."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "parlay", "train", "--backend", "torch", *FLAGS, "--steps", str(steps),
         "--collective-timeout", str(TIMEOUT), "--checkpoint-dir", str(ck), "--checkpoint-every", str(every), *extra],
        cwd=ck.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while latest(ck) is None:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.2)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2, ranks
    return proc, ranks


def _finish(proc, ranks, *, within: float):
    """(exit code, stderr's last line, seconds) once ``proc`` exits; every rank gone."""
    start = time.monotonic()
    _, err = proc.communicate(timeout=within + 60)
    took = time.monotonic() - start
    deadline = time.monotonic() + 5
    while any(_running(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r in ranks if _running(r)], "a rank outlived its launcher"
    assert took < within, f"took {took:.1f} s (bound {within} s): {err[-500:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else "", took


def _intact_and_resumable(ck: Path, capsys):
    """The newest committed checkpoint reads whole and continues one step (numpy backend)."""
    newest = latest(ck)
    c = Checkpoint(newest)
    for name in c.tensors:
        assert np.isfinite(c.read(name)).all()
    assert main(["train", "--backend", "numpy", *FLAGS, "--steps", str(c.step + 1), "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "1", "--resume"]) == 0, capsys.readouterr().err
    assert latest(ck).name == f"step-{c.step + 1:08d}"


# -- a rank that stops, dies or spins; the launcher killed or signalled ---------------------------------

def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, capsys):
    ck = tmp_path / "ck"
    proc, ranks = _start_train(ck)
    os.kill(ranks[1], signal.SIGSTOP)
    code, line, took = _finish(proc, ranks, within=TIMEOUT + 10)
    assert code == 1 and line.startswith("parlay: rank 1 is stopped (SIGSTOP or a debugger): no heartbeat for "), line
    assert "the newest committed checkpoint is" in line and took >= TIMEOUT - 1
    _intact_and_resumable(ck, capsys)


def test_a_killed_rank_is_named_at_once(tmp_path, capsys):
    ck = tmp_path / "ck"
    proc, ranks = _start_train(ck)
    os.kill(ranks[0], signal.SIGKILL)
    code, line, took = _finish(proc, ranks, within=8)
    assert code == 1 and line.startswith("parlay: rank 0 was killed by SIGKILL before returning"), line
    _intact_and_resumable(ck, capsys)


# SIGINT and SIGHUP take the same handler as SIGTERM: SIGINT under `make test-all` only.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.exhaustive)])
def test_sigterm_and_sigint_end_the_run_with_no_rank_left(tmp_path, sig, capsys):
    ck = tmp_path / "ck"
    proc, ranks = _start_train(ck)
    # Meanwhile a second run on the same folder is refused, naming the holder.
    assert main(["train", "--backend", "numpy", *FLAGS, "--steps", "100000", "--checkpoint-dir", str(ck),
                 "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"parlay: {ck}: another run is writing checkpoints here (pid {proc.pid} on ") \
        and err.endswith("wait for it to end, or give another folder"), err
    proc.send_signal(sig)
    code, line, _ = _finish(proc, ranks, within=8)
    assert code == 128 + sig and line.startswith(f"parlay: stopped by {sig.name}; no rank left running; the newest "
                                                 f"committed checkpoint is {ck}/step-"), line
    _intact_and_resumable(ck, capsys)


def test_killing_the_launcher_kills_its_ranks_and_frees_the_folder(tmp_path, capsys):
    ck = tmp_path / "ck"
    proc, ranks = _start_train(ck)
    proc.kill()  # no handler runs: the ranks must notice on their own
    _finish(proc, ranks, within=5)
    assert "pid" in (ck / checkpoint.LOCK_FILE).read_text()  # the dead run's name is left behind: stale
    _intact_and_resumable(ck, capsys)  # and taken over


def sleep_forever(rank):
    time.sleep(10**6)


def test_a_stop_while_ranks_start_kills_them_once_started():
    """SIGTERM in the first seconds (a rank forked but not yet "alive" for multiprocessing): the
    spawn stops its ranks as soon as they exist, not after its own deadline."""
    import threading

    from parlay.backends.torch.launch import RankFailure, spawn, stop_all

    failure = []
    thread = threading.Thread(target=lambda: failure.append(pytest.raises(RankFailure, spawn, sleep_forever, 2,
                                                                          timeout_s=TIMEOUT, wall_s=None)))
    thread.start()
    time.sleep(0.05)
    stop_all()
    thread.join(timeout=20)
    assert not thread.is_alive() and failure and "stopped" in str(failure[0].value)
    assert not [c for c in _children(os.getpid()) if _running(c) and b"spawn_main" in
                Path(f"/proc/{c}/cmdline").read_bytes()]


def spin(rank):
    """Rank 1 stops making progress (a busy loop) after a few all-reduces (a rank that raises:
    tests/test_differential.py)."""
    import torch
    import torch.distributed as dist

    from parlay.backends.torch.launch import mark_progress

    x = torch.ones(4)
    for i in range(10**6):
        mark_progress()
        dist.all_reduce(x)
        if i == 5 and rank == 1:
            while True:
                pass


def test_a_spinning_rank_is_named_not_the_one_waiting_for_it():
    from parlay.backends.torch.launch import RankFailure, spawn

    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"^rank 1 made no progress for \d+ s; rank 0's collective timed out after "
                                          rf"{TIMEOUT} s waiting for it"):
        spawn(spin, 2, timeout_s=TIMEOUT, wall_s=None)
    assert time.monotonic() - start < 60 + TIMEOUT  # start-up included


# -- the folder lock ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error", [
    ("from parlay.backends.torch.launch import spawn\n"
     "def work(rank):\n    return rank\n"
     "spawn(work, 2, timeout_s=30)", "exited with code 1 before returning; stopped the other ranks. It exited before"),
    ("from parlay.core.models.gpt import GPT, PRESETS\nfrom parlay.searching import search\n"
     "search(GPT(PRESETS['tiny']), 8, 8, 'cpu', workers=2)", "RuntimeError: search(workers=2): a worker process died"),
])
def test_a_script_without_a_main_guard_gets_one_clear_error(tmp_path, call, error):
    # Python's spawn start method imports the script again in each new process, which then starts
    # processes itself and dies: the launcher names the cause and the fix, at once, not a hang or
    # a BrokenProcessPool from deep inside concurrent.futures.
    script = tmp_path / "script.py"
    script.write_text(call + "\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and time.monotonic() - start < 60
    # the error is the script's last word (a resource_tracker warning about the dead workers' semaphores may follow)
    assert any(error in line and 'if __name__ == "__main__":' in line for line in done.stderr.splitlines()), \
        done.stderr[-2000:]


def test_the_lock_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from parlay.checkpoint import locked\n"
                               f"with locked({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderLocked, match=rf"another run is writing checkpoints here \(pid {holder.pid} on "):
            with locked(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with locked(tmp_path):  # SIGKILL released it: the stale file is taken over
        with locked(tmp_path):  # re-entrant within a process
            pass
        assert f"pid {os.getpid()} " in (tmp_path / checkpoint.LOCK_FILE).read_text()


# -- tampered checkpoints ---------------------------------------------------------------------------------

TP = ["--backend", "numpy", "--mesh", "tp=2", "--strategy", "tp", "--batch", "4", "--eval-batches", "1",
      "--eval-every", "2", "--no-cosine", "--warmup", "0"]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """Two runs of 4 steps on the same flags, checkpoints at 2 and 4, both ranks writing blocks."""
    out = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(name)
        assert main(["train", *TP, "--steps", "4", "--checkpoint-dir", str(d), "--checkpoint-every", "2",
                     "--seed", "0"]) == 0
        out.append(d)
    return out


@pytest.fixture
def ck(run_dirs, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(run_dirs[0], d)
    return d


def _resume_error(ck, capsys, *extra) -> str:
    """``--resume`` from the newest checkpoint refused with one line (before any step ran)."""
    capsys.readouterr()
    assert main(["train", *TP, "--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--resume",
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parlay: "), err
    assert latest(ck).name == "step-00000004"
    return err[0]


def _edit(path: Path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_both_ranks_wrote_pieces(run_dirs):
    files = {p.name for p in (run_dirs[0] / "step-00000004").iterdir()}
    assert {"rank-00000.safetensors", "rank-00001.safetensors", "manifest.json"} <= files


def test_a_rank_file_from_another_step_is_refused(ck, capsys):
    f = "rank-00001.safetensors"
    shutil.copy(ck / "step-00000002" / f, ck / "step-00000004" / f)
    err = _resume_error(ck, capsys)
    assert f"step-00000004/{f}: written as {{'run': " in err and "'step': 2" in err \
        and "a file from another step, run or rank" in err, err


def test_a_rank_file_from_another_run_at_the_same_step_is_refused(ck, run_dirs, capsys):
    f = "rank-00000.safetensors"
    shutil.copy(run_dirs[1] / "step-00000004" / f, ck / "step-00000004" / f)
    assert "a file from another step, run or rank" in _resume_error(ck, capsys)


def test_a_rank_file_renamed_into_another_ranks_place_is_refused(ck, capsys):
    step = ck / "step-00000004"
    shutil.copy(step / "rank-00000.safetensors", step / "rank-00001.safetensors")
    assert "'file': 'rank-00000.safetensors'" in _resume_error(ck, capsys)


def test_a_piece_whose_digest_the_manifest_does_not_hold_is_refused(ck, capsys):
    def flip(m):
        piece = next(iter(m["tensors"].values()))["pieces"][0]
        piece["sha256"] = ("0" if piece["sha256"][0] != "0" else "1") + piece["sha256"][1:]
    _edit(ck / "step-00000004", flip)
    assert "does not match the manifest's SHA-256" in _resume_error(ck, capsys)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(step=2), "field 'step' is 2 but the folder is step-00000004"),
    (lambda m: m.update(count=3), "field 'count' is 3 at step 4; a checkpoint has taken one update per step"),
    (lambda m: m.update(losses=m["losses"][:3]), "field 'losses' must hold 4 finite numbers (one per update), not 3"),
    (lambda m: m["losses"].__setitem__(0, float("nan")), "field 'losses' must hold 4 finite numbers"),
    (lambda m: m.update(evals=[[4, 1.0], [2, 1.0]]), "field 'evals' must be [step, loss] pairs at increasing steps"),
    (lambda m: m.update(run={}), "field 'run' must say the run's id"),
    (lambda m: m.update(version=2), "field 'version' is 2; this parlay reads version 3"),
])
def test_inconsistent_run_state_is_refused(ck, capsys, edit, message):
    _edit(ck / "step-00000004", edit)
    assert message in _resume_error(ck, capsys)


def test_a_fifo_in_place_of_a_rank_file_is_refused_not_waited_on(ck, capsys):
    f = ck / "step-00000004" / "rank-00000.safetensors"
    f.unlink()
    os.mkfifo(f)
    assert "rank-00000.safetensors: not a regular file" in _resume_error(ck, capsys)


def test_a_parameters_only_state_or_missing_data_digests_do_not_resume(ck, capsys):
    _edit(ck / "step-00000004", lambda m: m.update(count=0, losses=[], evals=[]))
    assert "holds parameters only (count 0 at step 4); start a new run from it with --init-from" in \
        _resume_error(ck, capsys)
    _edit(ck / "step-00000004", lambda m: m.update(count=4, losses=[1.0] * 4) or m["data"].update(sha256=None))
    assert "field 'data.sha256' must list one SHA-256 per --data file" in _resume_error(ck, capsys)


def test_a_folder_in_place_of_the_lock_file_is_one_error(ck, capsys):
    (ck / checkpoint.LOCK_FILE).unlink(missing_ok=True)
    (ck / checkpoint.LOCK_FILE).mkdir()
    assert "cannot be opened as parlay's lock file" in _resume_error(ck, capsys)


def test_a_deeply_nested_manifest_is_one_error(ck, capsys):
    (ck / "step-00000004" / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    assert _resume_error(ck, capsys).endswith("manifest.json: nested too deeply to be a parlay manifest")


def test_a_changed_data_file_is_refused_on_resume(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(32, 127)) * 400)
    d = tmp_path / "ck"
    assert main(["train", *TP, "--steps", "2", "--checkpoint-dir", str(d), "--checkpoint-every", "2",
                 "--data", str(data)]) == 0
    data.write_bytes(bytes(range(126, 31, -1)) * 400)  # same name and size, other bytes
    capsys.readouterr()
    assert main(["train", *TP, "--steps", "4", "--checkpoint-dir", str(d), "--resume", "--data", str(data)]) == 2
    assert f"--data {str(data)!r} changed since the checkpoint was saved" in capsys.readouterr().err


# -- bad output paths fail before the first step ---------------------------------------------------------------

@pytest.mark.parametrize("flag, target", [("--json", "{file}/x.json"), ("--checkpoint-dir", "{file}"),
                                          ("--json", "{tmp}/new-folder/"), ("--json", "/dev/full")])
def test_train_checks_its_output_paths_first(tmp_path, capsys, flag, target):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = target.format(file=blocker, tmp=tmp_path)
    start = time.monotonic()
    assert main(["train", *TP, "--steps", "100000", flag, target]) == 2
    err = capsys.readouterr()
    assert "train ━" not in err.out and time.monotonic() - start < 30
    assert err.err.startswith(f"parlay: {flag} {target!r}"), err.err


def test_compare_checks_its_output_paths_first(tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    if os.access(tmp_path / "ro", os.W_OK):  # root ignores permissions: use a file as the folder instead
        os.chmod(tmp_path / "ro", 0o700)
        shutil.rmtree(tmp_path / "ro")
        (tmp_path / "ro").write_text("")
    assert main(["compare", "--backends", "numpy", "--plot", str(tmp_path / "ro" / "p.png")]) == 2
    assert capsys.readouterr().err.startswith(f"parlay: --plot {str(tmp_path / 'ro' / 'p.png')!r}: cannot write in ")
    assert main(["compare", "--backends", "numpy", "--plot", str(tmp_path / "p.xyz")]) == 2
    assert "the file name must end in one of .png" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_the_collective_timeout_must_be_positive(value, capsys):
    assert main(["step", "--backend", "numpy", "--mesh", "dp=2", "--strategy", "dp", "--collective-timeout", value]) == 2
    assert f"--collective-timeout {float(value)} must be a positive number of seconds" in capsys.readouterr().err


def test_every_group_gets_the_collective_timeout():
    """The DeviceMesh's groups and parlay's own multi-axis groups wait --collective-timeout, not torch's 30 min."""
    from parlay.backends.torch.launch import spawn

    seconds = spawn(group_timeouts, 2, timeout_s=7)
    assert all(s == [7.0, 7.0, 7.0] for s in seconds), seconds


def group_timeouts(rank):
    import torch

    from parlay.backends.torch.mesh import TorchMesh
    from parlay.core import Mesh

    tm = TorchMesh(Mesh((("dp", 1), ("tp", 2))))
    groups = [tm.group(("dp",))[0], tm.group(("tp",))[0], tm.group(("dp", "tp"))[0]]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


# -- memory ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, part", [
    (["step", "--backend", "numpy", "--batch", "10000000"], "its largest value (10000000, 16, 256) 152.6 GiB"),
    (["train", "--backend", "numpy", "--eval-batches", "100000000"], "inputs 190.7 GiB: 100000001 batch(es) of 16"),
])
def test_runs_that_cannot_fit_this_machine_are_refused_before_they_start(argv, part, capsys):
    from parlay.cli import machine_bytes

    assert machine_bytes() < 150 * 2**30, "the bound is tested for machines under 150 GiB"
    assert main([*argv, "--mesh", "dp=2", "--strategy", "dp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parlay: this run needs at least ") and part in err and "lower --batch" in err, err


def test_a_data_file_is_read_only_as_far_as_the_corpus_goes(tmp_path):
    import tracemalloc

    from parlay.core.text import load_corpus

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        for _ in range(64):
            f.write(bytes(range(32, 127)) * (2**20 // 95 + 1))  # 64 MiB
    tracemalloc.start()
    corpus = load_corpus([big], max_bytes=2**20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(corpus.train) + len(corpus.held_out) == 2**20
    assert peak < 4 * 2**20, f"reading 1 MiB of a 64 MiB file peaked at {peak / 2**20:.0f} MiB"


def test_a_full_disk_during_a_save_is_one_error_naming_the_file(tmp_path, monkeypatch):
    import safetensors.numpy

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(CheckpointError, match=r"rank-00000.safetensors: cannot be written \(\[Errno 28\] No space left "
                                              r"on device\); the checkpoint of step 3 was not committed"):
        checkpoint.write_file(tmp_path, "rank-00000.safetensors", {"w@0": np.zeros(4, np.float32)}, run="r", step=3)
