"""parlay's command line: ``parlay <command> ...`` (also ``python -m parlay``)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .checkpoint import Checkpoint, CheckpointError, latest
from .core import Layout, Mesh, P, Plan, plan_redistribute
from .core.cost import PROFILES
from .core.traffic import NORM_BYTES
from .core.models.gpt import PRESETS
from .core.rules import RuleError
from .core.pipeline import PipelineError
from .core.precision import PRECISIONS
from .core.remat import REMATS
from .core.schedule import SCHEDULES, ScheduleError

__all__ = ["main"]

_DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8,
           "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached parlay: the run unwinds (every rank killed, locks
    released, committed checkpoints untouched) and parlay exits with 128 + the signal's number.
    A BaseException, so no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame):
    for s in _SIGNALS:  # a second signal must not interrupt the cleanup (ranks die with parlay anyway)
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def parse_mesh(text: str) -> Mesh:
    axes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        if not eq or not (size.strip().isascii() and size.strip().isdigit()):
            raise UsageError(f"--mesh {text!r}: {part!r} is not NAME=SIZE; write e.g. --mesh dp=2,tp=4")
        axes.append((name.strip(), int(size)))
    if not axes:
        raise UsageError(f"--mesh {text!r} names no axis; write e.g. --mesh dp=2,tp=4")
    return Mesh(axes)


def parse_shape(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise UsageError(f"--shape {text!r} is not a list of sizes; write e.g. --shape 8,16")
    return tuple(int(p) for p in parts)


def parse_axes(text: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


# -- pictures ------------------------------------------------------------------------------------

def layout_picture(layout: Layout, shape: Sequence[int], *, max_cells: int = 256) -> Table | Text:
    """Which ranks hold which block: rows are blocks of the leading dims, columns of the last.

    In a partial layout a block's ranks hold addends of it (marked with a Σ).
    """
    shape = tuple(shape)
    counts = [layout.shard_count(d) for d in range(len(shape))] or [1]
    rows, cols = math.prod(counts[:-1]), counts[-1]
    if rows * cols > max_cells:
        return Text(f"({rows * cols} blocks: too many to draw)")
    holders: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.mesh.size):
        holders.setdefault(tuple(layout.shard_index(r, d) for d in range(len(shape))), []).append(r)
    sigma = "Σ " if layout.partial else ""
    table = Table(show_header=False, show_lines=True, padding=(0, 1))
    for _ in range(cols):
        table.add_column(justify="center")
    for row in range(rows):
        lead = tuple(_unravel(row, counts[:-1]))
        table.add_row(*(Text(sigma + ",".join(map(str, holders.get(lead + (col,), [])))) for col in range(cols)))
    return table


def _unravel(i: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        i, c = divmod(i, s)
        out.append(c)
    return out[::-1]


def print_plan(plan: Plan, console: Console) -> None:
    src, dst = plan.src, plan.dst
    console.print(f"{src.mesh}, global shape {plan.shape}, {plan.itemsize} bytes per element", style="bold")
    console.print(f"src {src}  (local {src.local_shape(plan.shape)})  ->  dst {dst}  (local {dst.local_shape(plan.shape)})")
    if plan.mesh != src.mesh:
        console.print(f"the plan splits axes into sub-axes: {plan.mesh} (same rank numbers)")
    steps = Table(title="plan", title_justify="left")
    steps.add_column("#", justify="right")
    steps.add_column("step")
    steps.add_column("layout after")
    steps.add_column("bytes sent / device", justify="right")
    for i, (step, sent) in enumerate(zip(plan.steps, plan.step_bytes)):
        steps.add_row(str(i + 1), Text(str(step)), Text(str(plan.layouts[i + 1])), f"{max(sent):,}")
    if not plan.steps:
        steps.add_row("-", "nothing to move: src and dst hold the same data", "", "0")
    console.print(steps)
    console.print(f"total: {plan.bytes_per_device:,} bytes sent by the busiest device (ring algorithms)", style="bold")
    pictures = Table(show_header=True, box=None, padding=(0, 4))
    pictures.add_column(Text(f"before: {src}"))
    pictures.add_column(Text(f"after: {dst}"))
    pictures.add_row(layout_picture(src, plan.shape), layout_picture(dst, plan.shape))
    console.print(pictures)
    lead = "dim 0" if len(plan.shape) == 2 else f"dims 0..{len(plan.shape) - 2}"
    legend = f"each cell is a block; it lists the ranks that hold it. Rows: blocks of {lead}; columns: blocks of dim {len(plan.shape) - 1}."
    if len(plan.shape) == 1:
        legend = "each cell is a block of dim 0; it lists the ranks that hold it."
    if src.partial or dst.partial:
        legend += (" Σ: the block is a pending sum; the ranks that differ along the partial axes hold "
                   "its addends (ranks that differ only along replicated axes hold the same addend).")
    console.print(legend, style="dim")


# -- commands ------------------------------------------------------------------------------------

def _cmd_redistribute(args: argparse.Namespace, console: Console) -> int:
    mesh = parse_mesh(args.mesh)
    shape = parse_shape(args.shape)
    if args.dtype not in _DTYPES:
        raise UsageError(f"--dtype {args.dtype!r} is unknown; choose one of {', '.join(_DTYPES)}")
    src = Layout(mesh, P.parse(args.src), parse_axes(args.src_partial))
    dst = Layout(mesh, P.parse(args.dst), parse_axes(args.dst_partial))
    plan = plan_redistribute(src, dst, shape, itemsize=_DTYPES[args.dtype])
    print_plan(plan, console)
    return 0


def _cmd_schedule(args: argparse.Namespace, console: Console) -> int:
    from .core.schedule import Costs, make_schedule, simulate_schedule
    from .scheduling import parse_costs, plot_schedule, print_schedule, schedule_json

    check_output_file(args.json, "--json")
    check_output_file(args.plot or None, "--plot", (".png", ".svg", ".pdf"))
    if args.pp < 1 or args.microbatches < 1:
        raise UsageError(f"--pp {args.pp} and --microbatches {args.microbatches} must be positive")
    f, i, w = parse_costs(args.costs)
    if args.comm < 0 or args.activation_bytes < 0:
        raise UsageError(f"--comm {args.comm} and --activation-bytes {args.activation_bytes} must be >= 0")
    sched = make_schedule(args.schedule, args.pp, args.microbatches, virtual=args.virtual_stages)
    sim = simulate_schedule(sched, Costs(f=f, i=i, w=w, comm=args.comm, activation_bytes=args.activation_bytes))
    print_schedule(sim, console, comms=args.comms)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(schedule_json(sim))
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_schedule(sim, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _backend_name(args) -> str:
    """torch, numpy, or jax in --mode explicit (default), gspmd or mpmd: a registry name."""
    if args.backend != "jax":
        if args.mode is not None:
            raise UsageError(f"--mode {args.mode} chooses JAX's execution mode; it does nothing with --backend "
                             f"{args.backend}")
        return args.backend
    return {"gspmd": "jax-gspmd", "mpmd": "jax-mpmd"}.get(args.mode, "jax")


def _check_counts(args) -> None:
    for flag in ("steps", "batch", "microbatches"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)} must be positive")
    if not 0 < args.collective_timeout < 10**6:  # NaN fails too
        raise UsageError(f"--collective-timeout {args.collective_timeout} must be a positive number of seconds "
                         f"(below 10^6)")


def check_output_file(path: str | None, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """A file the command writes after its run: its folder made and writable now, so a bad path
    fails before the first step rather than after the last."""
    if not path:
        return
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise UsageError(f"{flag} {path!r} is a folder; name a file to write")
    real = os.path.realpath(path)  # a link is written through: check where it points
    if os.path.exists(real) and not os.path.isfile(real):
        raise UsageError(f"{flag} {path!r} is not a regular file (a device or a pipe); name a file to write")
    if suffixes and os.path.splitext(real)[1].lower() not in suffixes:
        raise UsageError(f"{flag} {path!r}: the file name must end in one of {', '.join(suffixes)}")
    _check_writable_dir(os.path.dirname(real), f"{flag} {path!r}")


def check_output_dir(path: str | None, flag: str) -> None:
    if path:
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"{flag} {path!r} is a file; name a folder")
        _check_writable_dir(os.path.abspath(path), f"{flag} {path!r}")


def _check_writable_dir(folder: str, what: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".parlay-probe-")
        probe.close()
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {folder!r} ({e.strerror or e}); choose a writable place") from None


COMPARE_BACKENDS = "torch,jax,jax-gspmd,numpy"


def _program(args, mesh: Mesh, backends: list[str], **extra):
    """The flags every command that runs the model shares, checked by building its Program:
    model and strategy (presets, built-ins or FILE.py:NAME / module:NAME), sizes, machine limits."""
    from .core.optim import OptimizerConfig
    from .core.program import program_from
    from .core.session import get_backend

    _check_counts(args)
    for name in backends:
        get_backend(name).prepare(mesh)
    program = program_from(args.model, args.strategy, mesh, batch=args.batch,
                           optimizer=extra.get("optimizer", OptimizerConfig()), microbatches=args.microbatches,
                           schedule=args.schedule, virtual=args.virtual_stages, remat=args.remat,
                           precision=args.precision, offload=args.offload)
    if program.precision.mixed and "numpy" in backends:
        flag = "--backends torch,jax,jax-gspmd" if getattr(args, "backends", None) else "--backend torch or jax"
        raise UsageError(f"--precision {program.precision.name}: the numpy simulator computes in float32 only (numpy's "
                         f"einsum has no bfloat16); use {flag}, or --precision fp32")
    runs_on = getattr(program.model, "runs_on", None)  # a model written for one framework (NnxModel: JAX)
    refused = [b for b in backends if runs_on and b not in runs_on]
    if refused:
        raise UsageError(f"model {args.model} runs on {', '.join(runs_on)} only, not {', '.join(refused)}: use "
                         f"--backend jax --mode gspmd (compare: --backends jax-gspmd)")
    check_memory(program, batches=1 + getattr(args, "eval_batches", 0),
                 processes=mesh.size if "torch" in backends else 1)
    return program


def run_label(program) -> str:
    """The strategy, with the pipeline's schedule, the microbatches and the remat policy where set."""
    notes = []
    if program.pipeline is not None:
        notes.append(program.pipeline.schedule.name)
    if program.microbatches > 1:
        notes.append(f"{program.microbatches} microbatches")
    if program.remat.value != "none":
        notes.append(f"remat {program.remat.value}")
    if program.precision.mixed:
        notes.append(program.precision.name)
    if program.offload:
        notes.append("optimizer offload")
    return program.strategy.name + (f" ({', '.join(notes)})" if notes else "")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def print_memory(program, console: Console, backend: str) -> None:
    """The predicted bytes per device of one training step (core/memory.py), before it runs."""
    from .core.memory import memory_report

    r = memory_report(program, backend)
    if r.activations is None:
        console.print(f"memory per device (predicted): parameters {_size(r.params)}, gradients {_size(r.grads)}, AdamW "
                      f"{_size(r.optimizer)}, batch {_size(r.inputs)}; activations not predicted ({r.detail})",
                      soft_wrap=True)
        return
    adam = f"AdamW {_size(r.optimizer)}" if not r.host else f"AdamW none (its {_size(r.host)} in host memory)"
    console.print(f"memory per device (predicted): parameters {_size(r.params)}, gradients {_size(r.grads)}, {adam}, "
                  f"batch {_size(r.inputs)}, activations {_size(r.activations)} ({r.detail}), "
                  + (f"gradient accumulators {_size(r.accumulators)} (the sums JAX's loop carries across "
                     f"microbatches), " if r.accumulators else "") +
                  f"largest value {_size(r.largest)}: peak about {_size(r.peak)}; {100 * r.unsharded:.1f}% of the "
                  f"parameters' elements held whole on every rank", soft_wrap=True)


def note_pipeline(program, console: Console) -> None:
    """A line when a pipeline has fewer microbatches than ranks: most of each step is bubble."""
    from .core.schedule import simulate_schedule

    pipe = program.pipeline
    if pipe is not None and program.microbatches < pipe.ranks:
        bubble = simulate_schedule(pipe.schedule).bubble
        console.print(f"note: {program.microbatches} microbatch(es) on {pipe.ranks} pipeline ranks: each rank idles "
                      f"{bubble:.0%} of a step ({pipe.schedule.name}, equal stage costs); --microbatches "
                      f"{2 * pipe.ranks} or more shrinks it")


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(program, *, batches: int, processes: int, limit: int | None = None) -> None:
    """Refuse a run that cannot fit this machine's memory (``limit``: its RAM), by a lower bound
    of what it must hold: the model's state once (parameter, gradient, two AdamW moments: 16 bytes
    a parameter), ``batches`` batches of inputs in each of ``processes`` processes (a training
    batch and the held-out set), and the largest value the model computes, which exists at some
    point (the shape trace found it). Activations beyond that one value are not counted (parlay
    has no memory model yet), so a run that passes may still not fit."""
    limit = machine_bytes() if limit is None else limit
    state = 16 * sum(int(math.prod(s)) for s in program.shapes.values())
    per_batch = sum(4 * int(math.prod(d.shape)) for d in program.model.inputs(program.batch).values())
    inputs = per_batch * batches * processes
    largest = 4 * int(math.prod(program.trace.largest))
    need = state + inputs + largest
    if need > limit:
        gib = lambda n: f"{n / 2**30:.1f} GiB"
        raise UsageError(f"this run needs at least {gib(need)} (model state {gib(state)}, inputs {gib(inputs)}: "
                         f"{batches} batch(es) of {program.batch} in {processes} process(es), its largest value "
                         f"{program.trace.largest} {gib(largest)}); this machine has {gib(limit)}: lower --batch"
                         + (" or --eval-batches" if batches > 1 else ""))


def _cmd_step(args: argparse.Namespace, console: Console) -> int:
    from .stepping import run_steps

    mesh = parse_mesh(args.mesh)
    backend = _backend_name(args)
    if args.ranks is not None and backend != "torch":
        raise UsageError(f"--ranks is the number of torch processes; {backend} runs in this process")
    if args.ranks is not None and args.ranks != mesh.size:
        raise UsageError(f"--ranks {args.ranks}: {mesh} has {mesh.size} ranks; the torch backend starts one process "
                         f"per rank (leave --ranks out)")
    program = _program(args, mesh, [backend])
    print_memory(program, console, backend)
    rows = run_steps(backend, program, steps=args.steps, seed=args.seed, timeout_s=args.collective_timeout)
    what = backend + (f" ({mesh.size} gloo ranks)" if backend == "torch" else "")
    note_pipeline(program, console)
    table = Table(title=f"{args.model}, {run_label(program)} on {mesh}, {what}, batch {args.batch}, random inputs",
                  title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("ms", justify="right")
    for i, (loss, sec) in enumerate(rows):
        table.add_row(str(i + 1), f"{loss:.6f}", f"{1e3 * sec:.1f}")
    console.print(table)
    return 0


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import json

    from .core.program import program_from
    from .planning import plan_report, predict, print_plan

    for flag in ("batch", "microbatches"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)} must be positive")
    check_output_file(args.json, "--json", (".json",))
    if args.devices is not None:
        if args.check:
            raise UsageError("--check compiles one layout; with --devices N the search prints the command that "
                             "explains its best layout: run that with --check")
        return _plan_search(args, console)
    if not args.mesh or not args.strategy:
        raise UsageError("parlay plan needs --mesh and --strategy (one layout to explain) or --devices N (search the "
                         "layouts on N devices)")
    program = program_from(args.model, args.strategy, parse_mesh(args.mesh), batch=args.batch,
                           microbatches=args.microbatches, schedule=args.schedule, virtual=args.virtual_stages,
                           remat=args.remat, precision=args.precision, offload=args.offload)
    report = plan_report(program, args.backend)
    print_plan(report, console, f"{args.model}, {run_label(program)} on {program.mesh}, batch {args.batch}")
    print_memory(program, console, args.backend)
    data = report.to_json()
    if args.profile:
        t = predict(report, args.profile)
        if t is None:
            console.print(f"step time on {args.profile}: not predicted ({report.note})", soft_wrap=True)
        else:
            console.print(f"step time on {args.profile} (predicted, nothing overlapped): {1e3 * t.total:.3f} ms = "
                          f"compute {1e3 * t.compute:.3f} + collectives {1e3 * t.comm:.3f} (inside nodes "
                          f"{1e3 * t.intra:.3f}, across {1e3 * t.inter:.3f}) + optimizer {1e3 * t.optimizer:.3f}",
                          soft_wrap=True)
        data["predicted"] = {"profile": args.profile, **(t.to_json() if t is not None else {})}
    if args.check:
        data["check"] = _plan_check(report, console).to_json()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _plan_check(report, console: Console):
    """``parlay plan --check``: the plan beside what XLA compiles (backends/jax/plan_check.py)."""
    from .core import get_backend

    try:
        if report.program.pipeline is not None and report.backend != "jax":  # the loop's plan, not torch's
            from .planning import plan_report

            report = plan_report(report.program, "jax")
        check = get_backend("jax").check_plan(report)
    except ValueError as e:
        raise UsageError(str(e)) from None
    program = report.program
    if check.hlo:
        table = Table(title="the plan against XLA's compiled step (JAX explicit, this machine; bytes rank 0 / device "
                            "0 sends)", title_justify="left")
        for col in ("phase", "kind", "plan #", "plan bytes", "HLO #", "HLO bytes", "diff"):
            table.add_column(col, justify="left" if col in ("phase", "kind") else "right", no_wrap=True)
        for r in check.rows:
            verdict = "equal" if r.equal else f"{r.xla_bytes - r.plan_bytes:+,}"
            table.add_row(r.phase, r.kind, str(r.plan_count), f"{r.plan_bytes:,}", str(r.xla_count),
                          f"{r.xla_bytes:,}", verdict, style=None if r.equal else "yellow")
        console.print(table)
    else:
        console.print(f"a pipeline runs as JAX's tick loop: each device runs the branch its table row names each tick, "
                      f"which the HLO does not say, so its collectives are not compared with the HLO's; the jaxpr is "
                      f"read told pp rank 0's row, against the plan of JAX's loop (parlay plan --backend jax: each "
                      f"backward piece runs its stage's forward again; each gradient summed once a step)",
                      soft_wrap=True)
    _jax_table(check, console)
    if check.hlo:
        norm = (f"XLA all-reduces {check.norm_bytes:,} bytes of float32 partial sums, one per sharded parameter"
                if check.norm_bytes else "XLA needs none (no parameter is sharded)")
        console.print("equal: within 4 bytes a plan record + 1 an HLO instruction (the ring formula's rounding); "
                      "counts differ where XLA combines collectives of one group into one instruction. Left out of "
                      f"the rows, the clip norm: the plan states torch's one float64 all-reduce ({NORM_BYTES} bytes); "
                      f"{norm}.", soft_wrap=True)
    (pa, xa), (pp, xp) = check.activations, check.peak
    kept = "activations kept for the backward" + (" + gradient accumulators" if check.accumulators else "")
    console.print(f"memory, predicted / XLA: {kept} {_size(pa)} / {_size(xa)} (the "
                  f"gradient function's temporary bytes) = {pa / xa:.3f}; peak {_size(pp)} / {_size(xp)} (the step's "
                  f"arguments + outputs - donated + temporary bytes) = {pp / xp:.3f}", soft_wrap=True)
    if program.microbatches > 1 and program.pipeline is None:
        console.print(f"with {program.microbatches} microbatches both sides count the whole step: the plan each "
                      f"microbatch's forward and backward and the gradients' sums once, the HLO and the jaxpr the "
                      f"accumulation loop's body {program.microbatches} times (its trip count)", soft_wrap=True)
    if program.remat.value != "none":
        console.print(f"remat {program.remat.value}: the plan counts the collectives torch's recomputation runs again "
                      f"(a layer's, up to its last op that keeps a tensor for the backward); XLA recomputes only what "
                      f"the backward needs and can reuse a parameter gathered in the forward, so the HLO may hold fewer",
                      soft_wrap=True)
    acc = check.accumulation
    if acc and not check.jax_equal and program.pipeline is not None:
        why = [f"the loop fell back to a sum in every backward piece ({acc['fell_back']})"] if acc["fell_back"] else []
        if acc["per_microbatch"] and not acc["fell_back"]:
            why.append(f"{', '.join(acc['per_microbatch'])} (summed over two sets of axes, or over other axes on "
                       f"another stage) keep a sum in every backward piece")
        console.print("JAX's tick loop sums each gradient once a step after the loop where it can; the plan of it "
                      "counts that" + (": " + "; ".join(why) if why else ""), soft_wrap=True)
    elif acc and not check.jax_equal:  # why JAX explicit's sums differ from torch's (README, 'Gradient accumulation')
        why = [f"the step fell back to one sum per microbatch ({acc['fell_back']})"] if acc["fell_back"] else []
        if acc["per_microbatch"] and not acc["fell_back"]:
            why.append(f"{', '.join(acc['per_microbatch'])} (summed over two sets of axes) keep a sum per microbatch")
        why.append("a parameter used twice is summed once per step in JAX, once per use in torch")
        console.print(f"with {program.microbatches} microbatches JAX explicit sums each parameter's gradient once "
                      f"after the last where it can; the plan counts torch's sums: " + "; ".join(why), soft_wrap=True)
    if program.precision.dtype == "bfloat16" and not check.equal:
        console.print("bf16: XLA's CPU backend has no bf16 collectives and sends them as float32 (twice the bytes); "
                      "the plan counts bf16, as a GPU sends them", soft_wrap=True)
    if not check.hlo and not check.jax_equal:
        console.print("the plan of JAX's loop and its jaxpr differ in the rows marked", style="yellow", soft_wrap=True)
    if not check.equal:
        console.print("the plan and XLA move different bytes in the rows marked: README, 'Checking a plan against "
                      "XLA', says which differences are known and why", style="yellow", soft_wrap=True)
    return check


def _jax_table(check, console: Console) -> None:
    """``--check``'s rows of the plan beside JAX explicit's jaxpr, by phase, kind and axes."""
    table = Table(title="the plan against JAX explicit's program (its jaxpr before XLA; forward and backward, rank 0 "
                        "/ device 0; count and bytes)", title_justify="left")
    for col in ("phase", "kind", "axes", "plan #", "plan bytes", "JAX #", "JAX bytes", "diff"):
        table.add_column(col, justify="left" if col in ("phase", "kind", "axes") else "right", no_wrap=True)
    for phase, kind, axes, pc, pb, jc, jb in check.jax_rows:
        same = (pc, pb) == (jc, jb)
        table.add_row(phase, kind, ",".join(axes) or "-", str(pc), f"{pb:,}", str(jc), f"{jb:,}",
                      "equal" if same else f"{jc - pc:+} / {jb - pb:+,}", style=None if same else "yellow")
    console.print(table)


def _plan_search(args: argparse.Namespace, console: Console) -> int:
    """``parlay plan --devices N``: the searching.py search, its best layouts and why the others lost."""
    import json
    import time

    from .core.loading import load_model
    from .searching import print_search, search

    if args.devices < 1:
        raise UsageError(f"--devices {args.devices} must be positive")
    if args.memory is not None and args.memory <= 0:
        raise UsageError(f"--memory {args.memory} must be a positive number of GiB")
    if args.top < 1:
        raise UsageError(f"--top {args.top} must be positive")
    given = [f for f, v in (("--mesh", args.mesh), ("--strategy", args.strategy)) if v]
    if given:
        raise UsageError(f"--devices searches the mesh and strategy; drop {' and '.join(given)} (or drop --devices to "
                         f"explain that one layout)")
    model, _ = load_model(args.model)
    profile = args.profile or "h100"
    t0 = time.perf_counter()
    try:
        ranked, invalid, s = search(model, args.devices, args.batch, profile,
                                    memory=None if args.memory is None else args.memory * 2 ** 30, top=args.top,
                                    workers=min(4, os.cpu_count() or 1))
    except ValueError as e:
        raise UsageError(str(e)) from None
    seconds = time.perf_counter() - t0
    print_search(ranked, invalid, s, console, args.top, seconds, args.model)
    fit = [e for e in ranked if e.fits]
    if fit:
        console.print(f"to explain #1: parlay plan {fit[0].candidate.command(args.model, args.batch)} --profile "
                      f"{profile}", soft_wrap=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "devices": args.devices, "batch": args.batch, "profile": profile,
                       "memory_bytes": s.memory, "seconds": seconds, "unit_traces": s.traces,
                       "layouts": [e.to_json() for e in ranked],
                       "do_not_divide": [{"strategy": c.strategy(), "mesh": c.mesh_text(), "why": why}
                                         for c, why in invalid]}, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    import json

    from .compare import BACKENDS, Tolerance, drop_all_reduce, plot_compare, run_compare

    mesh = parse_mesh(args.mesh)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.precision != "fp32" and args.backends == COMPARE_BACKENDS:  # the simulator computes in float32 only
        backends = [b for b in backends if b != "numpy"]
        console.print(f"--precision {args.precision}: comparing {','.join(backends)} (the numpy simulator computes in "
                      f"float32 only)", soft_wrap=True)
    known = BACKENDS + ("jax-mpmd",)
    bad = [b for b in backends if b not in known]
    if len(set(backends)) < len(backends):
        raise UsageError(f"--backends {args.backends!r} names a backend twice")
    if bad or not backends:
        raise UsageError(f"--backends {args.backends!r}: {bad[0] if bad else 'none given'} is not a backend; choose from "
                         f"{','.join(known)}")
    if mesh.size > 8:
        raise UsageError(f"--mesh {args.mesh!r} has {mesh.size} ranks; compare runs every backend on this machine, at "
                         f"most 8")
    check_output_file(args.json, "--json")
    check_output_file(args.plot, "--plot", (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".tif", ".tiff"))
    program = _program(args, mesh, backends)
    tol = Tolerance.of(program.precision)
    if args.drop_all_reduce:
        layers = sorted({n.rsplit(".", 1)[0] for n in program.shapes})
        if args.drop_all_reduce not in layers:
            raise UsageError(f"--drop-all-reduce {args.drop_all_reduce!r} is not a layer of {args.model}; layers are "
                             f"{', '.join(layers)}")
        if backends == ["jax-gspmd"]:
            raise UsageError("--drop-all-reduce plants its fault in the sharded executor (torch, jax, numpy); GSPMD's "
                             "collectives are XLA's")
        program = program.replace(fault=drop_all_reduce(args.drop_all_reduce))
    ref, runs = run_compare(program, steps=args.steps, backends=backends, seed=args.seed, tol=tol,
                            timeout_s=args.collective_timeout)
    if args.drop_all_reduce and all(r.agree for r in runs if r.name != "jax-gspmd"):
        raise UsageError(f"--drop-all-reduce {args.drop_all_reduce}: no forward all-reduce ran in that layer under "
                         f"{program.strategy.name} on {mesh}, so no fault was planted; pick a layer whose output is a "
                         f"pending sum (e.g. an MLP or attention output under tp)")
    data = getattr(program.model, "dataset", None)
    source = "stdlib bytes" if args.model in PRESETS else ("its dataset" if callable(data) else "random inputs")
    note_pipeline(program, console)
    table = Table(title=f"{args.model}, {run_label(program)} on {mesh}, batch {args.batch}, {source}; loss per step",
                  title_justify="left")
    table.add_column("step", justify="right")
    refs = [ref, *ref.others]
    for r in refs:
        table.add_column(f"{r.name} (reference)" if ref.others else "reference (1 device)", justify="right")
    for r in runs:
        table.add_column(r.name, justify="right")
    for i in range(len(ref.losses)):
        table.add_row(str(i + 1), *(f"{r.losses[i]:.6f}" for r in refs + runs))
    table.add_section()
    pad = [""] * (len(refs) - 1)
    if ref.others:
        table.add_row("", *pad, "held to", *(r.reference for r in runs))
    table.add_row("", *pad, "max rel loss diff", *(f"{r.loss_diff:.1e}" for r in runs))
    table.add_row("", *pad, "step-1 gradients", *(f"{r.grad_diff:.1e}" for r in runs))
    table.add_row("", *pad, f"params after {args.steps}", *(f"{r.param_diff:.1e}" for r in runs))
    table.add_row("", *pad, "agree", *("yes" if r.agree else "NO" for r in runs))
    console.print(table)
    if program.precision.mixed:
        console.print(f"tolerance ({program.precision.name}: a few of its roundings; each run held to its own "
                      f"framework on one device): loss {tol.loss:g} relative, step-1 gradients {tol.grad:g} (per "
                      f"tensor, L2 of the difference over L2 of the reference's); parameters reported, not judged "
                      f"(Adam steps a gradient within a rounding of zero either way: compare.Tolerance.of)")
    else:
        console.print(f"tolerance: loss {tol.loss:g} relative, gradients {tol.grad:g} and parameters {tol.param:g} "
                      f"(per tensor, L2 of the difference over L2 of the reference's gradient / update)")
    if args.plot:
        plot_compare(ref, runs, args.plot, title=f"{args.model}, {program.strategy.name} on {mesh}", tol=tol)
        console.print(f"plot written to {args.plot}", soft_wrap=True)
    for r in runs:
        if not r.agree:
            console.print(f"{r.name} disagrees: worst gradient {r.worst_grad} ({r.grad_diff:.2e}), worst parameter "
                          f"{r.worst_param} ({r.param_diff:.2e})", style="bold red")
            if r.bisect is not None:
                for line in r.bisect.lines():
                    console.print(line, soft_wrap=True)
            elif r.bisect_note:
                console.print(r.bisect_note, soft_wrap=True)
    if args.json:
        report = {
            "model": args.model, "strategy": program.strategy.name, "mesh": dict(mesh.axes), "steps": args.steps,
            "batch": args.batch, "seed": args.seed, "reference_backend": ref.name,
            "tolerance": {"loss": tol.loss, "grad": tol.grad, "param": tol.param if math.isfinite(tol.param) else None},
            "reference": {"losses": ref.losses}, "precision": program.precision.name,
            "references": {r.name: {"losses": r.losses} for r in [ref, *ref.others]},
            "backends": {r.name: {"losses": r.losses, "reference": r.reference, "max_rel_loss_diff": r.loss_diff,
                                  "grad_rel_diff": r.grad_diff, "param_rel_diff": r.param_diff,
                                  "agree": r.agree,
                                  "bisect": r.bisect.to_json() if r.bisect is not None else None} for r in runs},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"report written to {args.json}", soft_wrap=True)
    return 0 if all(r.agree for r in runs) else 1


def _train_spec(args, mesh: Mesh, backend: str):
    """``parlay train``'s flags as a TrainSpec, each checked (one error for the first bad one)."""
    from .core.optim import OptimizerConfig
    from .training import TrainSpec

    _check_counts(args)
    if args.eval_every < 1:
        raise UsageError(f"--eval-every {args.eval_every} must be positive")
    if args.eval_batches < 0:
        raise UsageError(f"--eval-batches {args.eval_batches} must be >= 0")
    if args.warmup and args.warmup >= args.steps:
        raise UsageError(f"--warmup {args.warmup} is not shorter than --steps {args.steps}: the rate would never "
                         f"reach its peak and decay; lower --warmup (0: none)")
    for f in args.data or ():
        if not os.path.isfile(f):
            raise UsageError(f"--data {f!r} does not exist or is not a file; name readable files (or leave --data "
                             f"out for the model's default dataset)")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be >= 0 (0: never)")
    if args.keep_last < 1:
        raise UsageError(f"--keep-last {args.keep_last} must be >= 1")
    if args.resume and args.init_from:
        raise UsageError("--resume continues a run; --init-from starts a new one from a checkpoint's parameters: "
                         "give one of them")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every and --resume need --checkpoint-dir DIR")
    check_output_file(args.json, "--json")
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    optimizer = OptimizerConfig(lr=args.lr, warmup=args.warmup, decay_steps=args.steps if args.cosine else 0)
    return TrainSpec(backend=backend, strategy=args.strategy, mesh=tuple(mesh.axes), model=args.model,
                     steps=args.steps, batch=args.batch, microbatches=args.microbatches, schedule=args.schedule,
                     virtual_stages=args.virtual_stages, remat=args.remat, precision=args.precision,
                     offload=args.offload, seed=args.seed,
                     optimizer=optimizer,
                     eval_every=args.eval_every, eval_batches=args.eval_batches, data=tuple(args.data or ()),
                     checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                     keep_last=args.keep_last, collective_timeout=args.collective_timeout)


def _train_checkpoints(args, spec, program, console: Console):
    """(resume checkpoint, init checkpoint), checked before any process starts."""
    from .training import check_init, check_resume

    if args.checkpoint_dir and not args.resume:
        newest = latest(args.checkpoint_dir)
        if newest is not None:
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints of a run (newest "
                             f"{newest.name}); --resume it, or give a new folder")
    ckpt = init = None
    if args.resume:
        resume = latest(args.checkpoint_dir)
        if resume is None:
            raise UsageError(f"--resume: {args.checkpoint_dir!r} holds no committed checkpoint (step-NNNNNNNN folders "
                             f"with a manifest.json)")
        ckpt = Checkpoint(resume)
        check_resume(ckpt, spec, program)
        console.print(f"resuming from {resume} (steps {ckpt.step + 1}..{args.steps}; steps 1..{ckpt.step} ran on "
                      f"{ckpt.meta('backend')}, {ckpt.meta('strategy')} on {ckpt.meta('mesh')})", soft_wrap=True)
    if args.init_from:
        init = Checkpoint(args.init_from)
        check_init(init, program)
        console.print(f"starting from the parameters of {init.path} (fresh AdamW state, step 1)", soft_wrap=True)
    return ckpt, init


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from .checkpoint import locked
    from .training import dataset_of

    mesh = parse_mesh(args.mesh)
    backend = _backend_name(args)
    spec = _train_spec(args, mesh, backend)
    program = _program(args, mesh, [backend], optimizer=spec.optimizer)
    data = dataset_of(program.model, spec.data)  # bad data fails here, before any rank starts
    describe = getattr(data, "describe", None)
    baseline = getattr(data, "baseline", None)
    baseline = baseline() if callable(baseline) else None
    with locked(args.checkpoint_dir) if args.checkpoint_dir else contextlib.nullcontext():
        return _train(args, console, spec, program, data, describe, baseline)


def _train(args, console: Console, spec, program, data, describe, baseline) -> int:
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .core.model import dataset_source
    from .training import CheckpointEvent, EvalEvent, StepEvent, run_train, spec_json

    mesh, backend = program.mesh, spec.backend
    ckpt, init = _train_checkpoints(args, spec, program, console)
    what = backend + (f" ({mesh.size} gloo ranks)" if backend == "torch" else "")
    note_pipeline(program, console)
    print_memory(program, console, backend)
    console.print(f"{args.model}, {run_label(program)} on {mesh}, {what}: {args.steps} steps of {args.batch} examples "
                  f"of {describe() if callable(describe) else dataset_source(data)}"
                  + (f"; {baseline[0]} {baseline[1]:.3f}" if baseline else ""), soft_wrap=True)
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TextColumn("{task.fields[eps]} examples/s"), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=args.steps, loss="-", eps="-")
        clock = {"t0": None}

        def on_event(event):
            if isinstance(event, StepEvent):
                now = time.perf_counter()
                if clock["t0"] is None:
                    clock["t0"], clock["first"] = now, event.step
                done = event.step - clock["first"]
                eps = f"{done * args.batch / (now - clock['t0']):,.0f}" if done else "-"
                progress.update(task, completed=event.step, loss=f"{event.loss:.4f}", eps=eps)
            elif isinstance(event, EvalEvent):
                progress.console.print(f"step {event.step}: held-out loss {event.loss:.4f}")
            elif isinstance(event, CheckpointEvent):
                progress.console.print(f"step {event.step}: checkpoint saved to {event.path}", soft_wrap=True)

        try:
            result = run_train(spec, on_event, resume=ckpt, init_from=init, program=program)
        except (Stopped, RuntimeError, CheckpointError) as e:  # say what survives: the newest committed one
            if args.checkpoint_dir:
                newest = latest(args.checkpoint_dir)
                e.note = (f"; the newest committed checkpoint is {newest} (--resume continues it)" if newest else
                          "; no checkpoint was committed")
            raise
    final = result.evals[-1][1] if result.evals else float("nan")
    console.print(f"done in {result.seconds:.1f} s ({result.examples_per_s(spec):,.0f} examples/s after the first "
                  f"step): train loss {result.losses[-1]:.4f}, held-out loss {final:.4f}"
                  + (f" vs {baseline[0]} {baseline[1]:.4f}" if baseline else ""), soft_wrap=True)
    if args.json:
        report = {**spec_json(spec), "resumed_from": str(ckpt.path) if ckpt else None,
                  "init_from": str(init.path) if init else None, "source": dataset_source(data),
                  "baseline": {"name": baseline[0], "value": baseline[1]} if baseline else None,
                  "losses": result.losses, "eval": [{"step": t, "loss": l} for t, l in result.evals],
                  "seconds": result.seconds, "examples_per_s": result.examples_per_s(spec)}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"losses written to {args.json}", soft_wrap=True)
    return 0


def _cmd_export_hf(args: argparse.Namespace, console: Console) -> int:
    from .hf import checkpoint_to_hf

    out = checkpoint_to_hf(args.checkpoint, args.out)
    console.print(f"wrote {out} (config.json + model.safetensors; transformers' from_pretrained reads it)", soft_wrap=True)
    return 0


def _cmd_import_hf(args: argparse.Namespace, console: Console) -> int:
    from .hf import hf_to_checkpoint

    out = hf_to_checkpoint(args.folder, args.checkpoint_dir, step=args.step)
    console.print(f"wrote {out} (parameters, zero AdamW moments)", soft_wrap=True)
    return 0


_MODEL_HELP = ("a preset (" + ", ".join(PRESETS) + ") or your own: FILE.py:NAME or package.module:NAME, NAME a model "
               "object or a function of no arguments returning one (see parlay.core.model)")
_STRATEGY_HELP = ("built-in strategies joined by '+' (dp, zero1, zero2, fsdp, tp, tp_sp, ulysses, tp2d, pp; e.g. "
                  "fsdp+tp, pp+dp) "
                  "or your own Strategy: FILE.py:NAME or package.module:NAME; NAME@AXES puts one on other mesh "
                  "axes (dp@replica+fsdp@shard: hybrid sharding)")


def _add_run_flags(p: argparse.ArgumentParser, *, steps: int | None, batch: int, mesh: str | None = None,
                   strategy: str | None = None) -> None:
    """The flags of every command that runs the model (checked by ``_program``); a ``None``
    default makes the flag required."""
    p.add_argument("--model", default="tiny", help=_MODEL_HELP)
    p.add_argument("--mesh", default=mesh, required=mesh is None, help="mesh axes and sizes, e.g. dp=2,tp=4")
    p.add_argument("--strategy", default=strategy, required=strategy is None, help=_STRATEGY_HELP)
    if steps is not None:  # parlay plan runs nothing
        p.add_argument("--steps", type=int, default=steps, help="training steps (AdamW updates)")
    p.add_argument("--batch", type=int, default=batch, help="examples per step (global: split by the strategy)")
    p.add_argument("--microbatches", type=int, default=1, metavar="K",
                   help="run each step's batch as K microbatches of batch/K, their gradients summed before the one "
                        "update (gradient accumulation: the same step as one batch, a K-th of the activations); "
                        "with the pp strategy, the pipeline's microbatches")
    p.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="the pipeline schedule, with the pp strategy (none given: 1f1b); see parlay schedule")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="pipeline stages a pp rank runs (none given: interleaved 2, zbv 2, the others 1)")
    p.add_argument("--remat", default="none", choices=REMATS,
                   help="activation checkpointing of each repeated layer: keep every value (none), keep only the "
                        "layer's input and recompute the rest in the backward (block), or keep its input and "
                        "attention output (selective)")
    p.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS),
                   help="the dtype the ops compute in: fp32, bf16 or fp16 (with dynamic loss scaling); parameters, "
                        "AdamW's states, norms, softmax, the loss and every summing collective stay float32; "
                        "bf16-sum16 is bf16 with an activation's sums (tensor-parallel all-reduces, reduce-scatters) "
                        "in bf16, as Megatron-LM runs them")
    p.add_argument("--offload", action="store_true",
                   help="keep AdamW's states in host memory (ZeRO-Offload's placement): JAX moves them in for the "
                        "update, torch steps them there with its fused CPU AdamW; without a pipeline; under zero1, "
                        "zero2 or fsdp each device's shard")
    if steps is None:
        return
    p.add_argument("--seed", type=int, default=0, help="the parameters' initialisation and the data order")
    p.add_argument("--collective-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="torch: the longest one collective may wait, and a rank may go without a heartbeat, before "
                        "the run stops naming the rank")


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("torch", "jax", "numpy"), default="torch",
                   help="torch: one gloo process per rank; jax: this process's host devices; numpy: the simulator")
    p.add_argument("--mode", choices=("explicit", "gspmd", "mpmd"), default=None,
                   help="jax: shard_map on parlay's plans (explicit, the default; a pipeline is one compiled tick "
                        "loop), jit with shardings (gspmd), or explicit with a pipeline's stages as one program "
                        "each, driven from Python (mpmd)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="parlay", description="Parallel layouts written once, run on PyTorch and JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser(
        "redistribute",
        help="plan the collectives that turn one layout into another, and draw both",
        description="Plan a redistribution between two layouts of one tensor on one mesh. A spec lists one "
                    "entry per dim: an axis, None, or several axes in parentheses, e.g. \"(dp,tp),None\".",
    )
    r.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. dp=2,tp=4")
    r.add_argument("--shape", required=True, help="global shape, e.g. 8,16")
    r.add_argument("--src", required=True, help='source spec, e.g. "dp,tp"')
    r.add_argument("--dst", required=True, help='destination spec, e.g. "None,dp"')
    r.add_argument("--src-partial", default="", help="axes over which the source holds pending sums, e.g. tp")
    r.add_argument("--dst-partial", default="", help="axes over which the destination keeps pending sums")
    r.add_argument("--dtype", default="float32", help="element type, for the byte counts (default float32)")
    r.set_defaults(run=_cmd_redistribute)
    t = sub.add_parser(
        "step", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a few training steps of a model with a strategy, on one batch of random inputs",
        description="Training steps of a model on one batch of random inputs (the same batch every step): a "
                    "smoke test of a strategy on a mesh. On the torch backend parlay starts one gloo process per "
                    "rank itself.",
    )
    _add_backend_flags(t)
    _add_run_flags(t, steps=5, batch=8)
    t.add_argument("--ranks", type=int, default=None, help="torch: processes to spawn (must be the mesh size)")
    t.set_defaults(run=_cmd_step)
    c = sub.add_parser(
        "compare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="the same model, weights and batches on every backend against one device",
        description="Run the single-device reference (JAX) and each backend (torch on spawned gloo ranks, JAX "
                    "explicit, JAX GSPMD, the numpy simulator) for N AdamW steps on the model's dataset (the "
                    "GPT: the Python standard library's bytes; a model without one: random inputs); print the "
                    "losses and the largest relative differences; exit 1 if a backend disagrees beyond the "
                    "tolerance, and name where it parts.",
    )
    _add_run_flags(c, steps=5, batch=8, mesh="dp=2,tp=2", strategy="dp+tp")
    c.add_argument("--backends", default=COMPARE_BACKENDS,
                   help="which to run against the reference (also jax-mpmd: explicit mode with a pipeline's stages "
                        "as separate programs)")
    c.add_argument("--json", default=None, help="write the report (losses per step, differences) here")
    c.add_argument("--plot", default="out/compare.png", help="write the PNG plot here ('' for none)")
    c.add_argument("--drop-all-reduce", default=None, metavar="LAYER",
                   help="fault injection: the sharded executor (torch, jax, numpy) drops the forward all-reduces "
                        "of one layer, e.g. blocks.1.mlp; watch the bisect name it")
    c.set_defaults(run=_cmd_compare)
    tr = sub.add_parser(
        "train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="train a model on its dataset (the GPT: the standard library's source) on any backend",
        description="Train a model on its dataset, with a held-out part for evaluation: a preset GPT byte-level "
                    "on the Python standard library's source files (on every machine) or on --data files, or "
                    "your own model (FILE.py:NAME) on its dataset(). A progress bar with the loss, examples/s and "
                    "ETA; the held-out loss every --eval-every steps.",
    )
    _add_backend_flags(tr)
    _add_run_flags(tr, steps=300, batch=16, mesh="dp=2,tp=2", strategy="dp+tp")
    tr.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    tr.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    tr.add_argument("--no-cosine", dest="cosine", action="store_false",
                    help="keep the rate after warmup (default: cosine decay to 10%% at the last step)")
    tr.add_argument("--eval-every", type=int, default=50, help="held-out loss every K steps (and at the end)")
    tr.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    tr.add_argument("--data", nargs="+", default=None, metavar="FILE",
                    help="files for the model's dataset (the GPT: text files to train on)")
    tr.add_argument("--json", default=None, help="write every step's loss and the evaluations here")
    tr.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="where checkpoints are saved and resumed from")
    tr.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="save every K steps and after the last")
    tr.add_argument("--keep-last", type=int, default=3, help="committed checkpoints to keep (default 3)")
    tr.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                    help="start from this checkpoint folder's parameters (e.g. one parlay import-hf wrote), with a "
                         "fresh optimizer, at step 1")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in --checkpoint-dir (any backend, strategy or mesh) "
                         "to --steps")
    tr.set_defaults(run=_cmd_train)
    pl = sub.add_parser(
        "plan", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="what one training step of a strategy sends and holds per device, before anything runs",
        description="Explain a layout before launch: every collective of one training step on rank 0 (kind, mesh "
                    "axes, bytes; forward, backward and the optimizer step; per layer and in total), the memory "
                    "per device (parameters, gradients, AdamW's states, activations, peak), the share of "
                    "parameters held whole on every rank, a pipeline's bubble. Nothing runs: the step is traced "
                    "on shapes on this CPU, for any mesh size.",
    )
    _add_run_flags(pl, steps=None, batch=8, mesh="", strategy="")
    pl.add_argument("--devices", type=int, default=None, metavar="N",
                    help="instead of --mesh and --strategy: search the layouts of the model on N devices (meshes of "
                         "pp, dp, ulysses/ring and tensor axes; dp/zero1/zero2/fsdp, tp/tp_sp/2D/2.5D/3D, pp with "
                         "1F1B or interleaved, microbatch sizes, block remat, precision) and print the best by "
                         "predicted step time on --profile (default h100), with why the others lost")
    pl.add_argument("--memory", type=float, default=None, metavar="GIB",
                    help="with --devices: the memory of one device a layout must fit in (default: the profile's)")
    pl.add_argument("--top", type=int, default=5, metavar="K", help="with --devices: how many layouts to print")
    pl.add_argument("--backend", choices=("torch", "jax"), default="torch",
                    help="whose pipeline the plan counts: torch keeps each in-flight microbatch's graph; JAX's tick "
                         "loop keeps each stage's input and runs the stage's forward again in each backward piece")
    pl.add_argument("--profile", default=None, choices=sorted(PROFILES),
                    help="predict the step's time on this hardware (core/cost.py: h100, h200, a100 nodes of 8 with "
                         "InfiniBand between them; cpu: this machine's 8 fake JAX devices)")
    pl.add_argument("--check", action="store_true",
                    help="also compile the step on this machine's JAX devices (explicit mode, nothing runs) and put "
                         "the plan beside XLA: collective bytes by kind against the optimized HLO's (not under a "
                         "pipeline), every collective against JAX explicit's jaxpr, activations and peak against "
                         "memory_analysis()")
    pl.add_argument("--json", default=None, help="write the report here")
    pl.set_defaults(run=_cmd_plan)
    e = sub.add_parser("export-hf", help="a parlay checkpoint as a Hugging Face folder (GPT-2 or LLaMA)",
                       description="Write a checkpoint's parameters as config.json + model.safetensors that "
                                   "transformers loads (GPT2LMHeadModel or LlamaForCausalLM, by the model's options).")
    e.add_argument("checkpoint", help="a checkpoint folder, e.g. ckpt/step-00000300")
    e.add_argument("out", help="the folder to write")
    e.set_defaults(run=_cmd_export_hf)
    i = sub.add_parser("import-hf", help="a Hugging Face GPT-2 or LLaMA folder as a parlay checkpoint",
                       description="Read config.json + safetensors (never pickle) and write a parlay checkpoint.")
    i.add_argument("folder")
    i.add_argument("checkpoint_dir", help="where the step folder is written")
    i.add_argument("--step", type=int, default=0)
    i.set_defaults(run=_cmd_import_hf)
    s = sub.add_parser(
        "schedule", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a pipeline schedule: its action table, bubble, peak memory and a PNG timeline",
        description="Build a pipeline schedule (per-rank lists of forward, backward, input-gradient and "
                    "weight-gradient actions), check it (dependencies, matched sends, no deadlock) and simulate it "
                    "with the given per-stage costs: the makespan, each rank's idle time, the bubble fraction, the "
                    "most microbatches each rank holds, the bytes each rank sends; draws the timeline.",
    )
    s.add_argument("--pp", type=int, required=True, help="pipeline ranks (the pp axis's size)")
    s.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    s.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1 or zbv")
    s.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per rank (interleaved: default 2; zbv: 2; the others: 1)")
    s.add_argument("--costs", default="1,1,1", help="F,I,W: a stage's forward, input-gradient and weight-gradient "
                                                     "times (a whole backward B is I + W); a stage is 1/v of a rank's "
                                                     "layers, so to compare schedules on one model divide by v")
    s.add_argument("--comm", type=float, default=0.0, help="time for a value to cross between ranks")
    s.add_argument("--activation-bytes", type=int, default=0, help="bytes of one stage's output per microbatch")
    s.add_argument("--comms", action="store_true", help="list the sends and receives in the table too")
    s.add_argument("--json", default=None, help="write the schedule, its figures and timeline here")
    s.add_argument("--plot", default="out/schedule.png", help="write the timeline picture here ('' for none)")
    s.set_defaults(run=_cmd_schedule)
    return parser


def _raised_by_parlay(e: BaseException) -> bool:
    """Whether parlay's own checks raised ``e`` (its innermost frame is parlay's code): bad input,
    one line; an error from inside numpy, torch or JAX is not."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return True
    here = os.path.dirname(os.path.abspath(__file__))
    last = os.path.abspath(frames[-1].filename)
    return last.startswith(here + os.sep) and "site-packages" not in last


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(markup=False, highlight=False)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, _on_signal) for s in _SIGNALS}
    try:
        args = build_parser().parse_args(argv)
        return args.run(args, console)
    except Stopped as e:
        print(f"parlay: stopped by {e}; no rank left running{getattr(e, 'note', '')}", file=sys.stderr)
        return 128 + e.signum
    except UsageError as e:
        print(str(e) if str(e).startswith("parlay") else f"parlay: {e}", file=sys.stderr)
        return 2
    except (RuleError, ScheduleError, PipelineError) as e:  # every bullet: each is a separate problem to fix
        print(f"parlay: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        if not _raised_by_parlay(e):
            raise  # from inside a library: a bug to report, with its traceback
        print(f"parlay: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a rank that failed, a run that diverged: the run itself went wrong
        from .core.session import RunFailure
        from .training import TrainingDiverged

        if not isinstance(e, (RunFailure, TrainingDiverged)):
            raise
        print(f"parlay: {str(e).splitlines()[0]}{getattr(e, 'note', '')}", file=sys.stderr)
        return 1
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
