"""``parlay schedule``: a pipeline schedule's table, its simulated figures and a timeline picture.

The schedule and its figures come from ``core.schedule``; this module only shows them: the
action list of each rank (optionally with its point-to-point ops), a timeline grid where every
cost is a whole number, a per-rank table (busy, idle, peak microbatches held, bytes sent), and a
PNG timeline drawn the way the zero-bubble paper draws its schedules (ranks down, time across).
"""

from __future__ import annotations

import json
from rich.console import Console
from rich.table import Table

from .core.schedule import Op, Simulation

__all__ = ["print_schedule", "plot_schedule", "schedule_json"]

# F blue, B (whole backward) orange, I teal, W grey-green: the zero-bubble paper's palette.
_COLOURS = {Op.F: "#4c78a8", Op.B: "#f58518", Op.I: "#54a24b", Op.W: "#b7c9a8"}
_MAX_GRID = 160  # timeline columns printed in the terminal


def print_schedule(sim: Simulation, console: Console, *, comms: bool = False) -> None:
    sc = sim.schedule
    console.print(f"{sc.name} schedule: p={sc.ranks} ranks, m={sc.microbatches} microbatches, "
                  f"{sc.stages} stages ({sc.virtual} a rank, {sc.placement.value} placement); costs F={_num(sim.costs.f)} "
                  + (f"I={_num(sim.costs.i)} W={_num(sim.costs.w)}" if sc.splits_backward
                     else f"B={_num(sim.costs.b if sim.costs.b is not None else sim.costs.of(Op.B))}")
                  + (f", comm {sim.costs.comm:g}" if sim.costs.comm else ""))
    console.print(sc.table(comms=comms), soft_wrap=True)
    grid = _grid(sim)
    if grid:
        console.print("\ntimeline (one column per time unit; stage.microbatch, '.' idle):")
        console.print(grid, soft_wrap=True)
    table = Table(title=None)
    for col in ("rank", "stages", "busy", "idle", "idle share", "peak held", "peak activations", "bytes sent"):
        table.add_column(col, justify="right")
    for r in range(sc.ranks):
        table.add_row(str(r), ",".join(map(str, sc.stages_of(r))), f"{sim.busy[r]:g}", f"{sim.idle[r]:g}",
                      f"{sim.idle[r] / sim.makespan:.4f}", str(sim.peak_in_flight[r]), f"{sim.peak_activations[r]:g}",
                      str(sim.bytes_sent[r]))
    console.print(table)
    console.print(f"makespan {sim.makespan:g}; bubble {sim.bubble:.4f} of the makespan "
                  f"({sum(sim.idle) / sum(sim.busy):.4f} of the ideal time); peak held: the most (stage, microbatch) "
                  f"activations a rank keeps at once (from F to the end of its B or W); peak activations: the same "
                  f"in microbatches of a 1/p share of the blocks.")


def _num(v) -> str:
    return ",".join(f"{x:g}" for x in v) if isinstance(v, (tuple, list)) else f"{v:g}"


def _grid(sim: Simulation) -> str | None:
    if sim.makespan > _MAX_GRID or any(not float(t).is_integer() for row in sim.timeline for s, e, _ in row
                                       for t in (s, e)):
        return None
    width = max(len(f"{a.op.value}{a.stage}.{a.microbatch}") for row in sim.timeline for _, _, a in row) + 1
    lines = []
    for r, row in enumerate(sim.timeline):
        cells = ["."] * int(sim.makespan)
        for s, e, a in row:
            for t in range(int(s), int(e)):
                cells[t] = f"{a.op.value}{a.stage}.{a.microbatch}"
        lines.append(f"rank {r}: " + "".join(c.rjust(width) for c in cells))
    return "\n".join(lines)


def plot_schedule(sim: Simulation, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sc = sim.schedule
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, sim.makespan * 0.3)), 0.6 * sc.ranks + 1.4))
    for r, row in enumerate(sim.timeline):
        for start, end, a in row:
            # later chunks of a rank (virtual stages) are drawn lighter
            chunk = sc.stages_of(r).index(a.stage)
            alpha = 1.0 - 0.35 * chunk / max(1, sc.virtual - 1) if sc.virtual > 1 else 1.0
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=_COLOURS[a.op], alpha=alpha,
                           edgecolor="white", linewidth=0.6)
            if end - start >= 0.6:
                ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center", fontsize=7, color="white"
                        if a.op in (Op.F, Op.B) else "black")
    ax.set_yticks(range(sc.ranks), [f"rank {r}" for r in range(sc.ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time")
    ops = [Op.F, Op.I, Op.W] if sc.splits_backward else [Op.F, Op.B]
    ax.legend(handles=[Patch(color=_COLOURS[o], label=o.value) for o in ops], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"{sc.name}: p={sc.ranks}, m={sc.microbatches}, v={sc.virtual}; bubble {sim.bubble:.3f}, "
                 f"peak held {max(sim.peak_in_flight)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def schedule_json(sim: Simulation) -> str:
    sc = sim.schedule
    return json.dumps({
        "schedule": sc.name, "ranks": sc.ranks, "microbatches": sc.microbatches, "virtual": sc.virtual,
        "placement": sc.placement.value, "actions": [[str(a) for a in acts] for acts in sc.actions],
        "with_comms": [[str(a) for a in acts] for acts in sc.with_comms()],
        "costs": {"f": sim.costs.f, "i": sim.costs.i, "w": sim.costs.w, "b": sim.costs.of(Op.B),
                  "comm": sim.costs.comm, "activation_bytes": sim.costs.activation_bytes},
        "makespan": sim.makespan, "bubble": sim.bubble, "busy": list(sim.busy), "idle": list(sim.idle),
        "peak_in_flight": list(sim.peak_in_flight), "peak_activations": list(sim.peak_activations),
        "bytes_sent": list(sim.bytes_sent),
        "timeline": [[[s, e, str(a)] for s, e, a in row] for row in sim.timeline],
    }, indent=1)


def parse_costs(text: str) -> tuple[float, float, float]:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or any(not v > 0 or v != v or v == float("inf") for v in values):
        raise ValueError(f"--costs {text!r}: give three positive numbers F,I,W (the times of a stage's forward, "
                         f"input gradient and weight gradient; B = I + W), e.g. 1,1,1.")
    return values[0], values[1], values[2]

