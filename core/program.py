"""A ``Program``: a model, a strategy, a mesh, a batch size and an optimizer, with every layout
resolved once and checked once.

``make_program`` traces the model on shapes (``core.shapes``), resolves the strategy's rules for
every parameter (as stored, in use, its gradient, its optimizer states), every input and every
constraint point, and checks each against its shape. It reports every problem at once, grouped
(a logical dim that does not divide, a rule that matches no tensor, a mesh axis that shards
nothing, a parameter used with other dims than it declared), as one ``ProgramError``. A program
that was built runs on every backend; the backends take their layouts from it and resolve nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .executor import Fault
from .layers import ParamDecl
from .mesh import Mesh
from .model import InputDecl, Model, check_model, model_init
from .pipeline import LAYERS, Pipeline, PipelineError, make_pipeline, pipeline_axis, pipeline_problems
from .precision import FP32, Precision, parse_precision
from .remat import Remat, check_remat, parse_remat
from .ring import SEQ_DIMS, SeqOrder, seq_dim
from .optim import OptimizerConfig
from .rules import RuleError, Rules
from .shapes import Trace, trace
from .spec import Layout, P
from .loading import load_strategy
from .strategies import Role, Strategy

__all__ = ["Program", "ProgramError", "make_program", "program_from", "PARAM_ROLES"]

PARAM_ROLES = (Role.PARAMS, Role.COMPUTE, Role.GRADS, Role.OPTIMIZER)


class ProgramError(RuleError):
    """A model, strategy and mesh that cannot run together; ``problems`` lists every reason."""


@dataclass(frozen=True)
class Program:
    """Build with ``make_program``. ``layouts[role][name]``: every parameter's layout per role
    (``Role.ACTIVATIONS``: every input's); ``activations[dims]``: every constraint point's."""

    model: Any
    strategy: Strategy
    mesh: Mesh
    batch: int
    optimizer: OptimizerConfig
    model_ref: str | None
    fault: Fault | None
    decls: tuple[ParamDecl, ...]
    inputs: Mapping[str, InputDecl]
    layouts: Mapping[Role, Mapping[str, Layout]]
    activations: Mapping[tuple, Layout]
    trace: Trace
    microbatches: int = 1  # a step of ``batch`` runs as this many microbatches of batch/microbatches
    pipeline: Pipeline | None = None  # the stages over a pp axis, where the strategy maps 'layers' to one
    remat: Remat = Remat.NONE  # which of each repeated layer's values the backward keeps (core/remat.py)
    precision: Precision = FP32  # the compute dtype, float32 sums and masters, fp16's loss scale (core/precision.py)
    offload: bool = False  # AdamW's states in host memory between steps (ZeRO-Offload's placement)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {d.name: d.shape for d in self.decls}

    @property
    def dims(self) -> dict[str, tuple]:
        return {d.name: d.dims for d in self.decls}

    def activation(self, dims: Sequence[str | None], shape: Sequence[int]) -> Layout:
        """The layout of a constraint point (resolved once; a point the trace did not see is
        resolved and checked now)."""
        dims = tuple(dims)
        layout = self.activations.get(dims)
        if layout is None:
            layout = _resolve_one(self.strategy.rules(Role.ACTIVATIONS), dims, self.mesh, f"activation {dims}")
        layout.check(tuple(shape))
        return layout

    @property
    def seq_order(self) -> SeqOrder | None:
        """The zigzag layout of the sequence (``Strategy.zigzag``; checked by ``make_program``)."""
        axes = self.strategy.zigzag
        if not axes:
            return None
        cached = self.__dict__.get("_seq_order")
        if cached is None:
            (seq,) = {d.shape[seq_dim(d.dims)] for d in self.inputs.values() if seq_dim(d.dims) is not None}
            cached = SeqOrder(tuple(axes), self.mesh.group_size(axes), seq)
            object.__setattr__(self, "_seq_order", cached)
        return cached

    def compute(self, name: str) -> Layout:
        """Where parameter ``name`` is handed to the model by ``ops.param`` (its compute layout)."""
        return self.layouts[Role.COMPUTE][name]

    def init(self, seed: int = 0):
        return model_init(self.model, seed)

    @property
    def micro(self) -> "Program":
        """The program of one microbatch (batch / microbatches examples; itself when there is one).
        Microbatch i of a batch is its rows i, i + k, i + 2k, ... (``microbatch_rows``): every rank's
        block of it is the same rows of the rank's own block, so no data moves to form it."""
        if self.microbatches == 1:
            return self
        cached = self.__dict__.get("_micro")
        if cached is None:
            cached = make_program(self.model, self.strategy, self.mesh, batch=self.batch // self.microbatches,
                                  optimizer=self.optimizer, model_ref=self.model_ref, fault=self.fault,
                                  remat=self.remat, precision=self.precision, offload=self.offload,
                                  _stage=self.pipeline is not None)
            object.__setattr__(self, "_micro", cached)
        return cached

    def replace(self, **changes) -> "Program":
        """The same program with other settings (``fault``, ``optimizer``, ``batch``, ...), checked again."""
        keep = dict(model=self.model, strategy=self.strategy, mesh=self.mesh, batch=self.batch,
                    optimizer=self.optimizer, model_ref=self.model_ref, fault=self.fault,
                    microbatches=self.microbatches, remat=self.remat, precision=self.precision,
                    offload=self.offload)
        if self.pipeline is not None:
            keep.update(schedule=self.pipeline.schedule.kind, virtual=self.pipeline.schedule.virtual)
        keep.update(changes)
        if set(changes) <= {"fault", "optimizer", "model_ref"}:
            return dataclasses.replace(self, **changes)
        return make_program(**keep)

    def __getstate__(self):
        # A model loaded from a file rebuilds from its reference in another process.
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # not the cached micro
        if self.model_ref is not None and _needs_ref(self.model):
            state["model"] = None
        return state

    def __setstate__(self, state):
        if state["model"] is None:
            from .loading import load_model

            state["model"] = load_model(state["model_ref"])[0]
        for k, v in state.items():
            object.__setattr__(self, k, v)


def _needs_ref(model) -> bool:
    """A model whose class lives in a file parlay loaded (no importable module name)."""
    from .loading import USER_PREFIX

    return type(model).__module__.startswith(USER_PREFIX)


def _rule_text(axes: tuple[str, ...]):
    return "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes)


def _resolve_one(rules: Rules, dims: tuple, mesh: Mesh, what: str) -> Layout:
    spec, problems = rules._resolve(what, dims, mesh)
    if problems:
        raise ProgramError(f"rules do not fit {mesh} for {what}:", problems)
    return Layout(mesh, spec)


class _Problems:
    """Problems found while building a program, with divisibility failures grouped."""

    def __init__(self, mesh: Mesh, strategy: Strategy):
        self.mesh, self.strategy = mesh, strategy
        self.items: list[str] = []
        self.divisibility: dict[tuple, list[str]] = {}

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)

    def check(self, where: str, dims: tuple, shape: tuple, spec: P, role: Role) -> bool:
        ok = True
        for d, (name, n) in enumerate(zip(dims, shape)):
            axes = spec.dim_axes(d)
            k = self.mesh.group_size(axes)
            if n % k:
                roles, places = self.divisibility.setdefault((name, n, axes), ({}, {}))
                roles[role.value] = places[f"{where} dim {d}"] = None
                ok = False
        return ok

    def raise_if_any(self, headline: str) -> None:
        out = list(self.items)
        for (name, n, axes), (roles, places) in self.divisibility.items():
            sizes = " x ".join(f"{a}={self.mesh.axis_size(a)}" for a in axes)
            k, where = self.mesh.group_size(axes), list(places)
            at = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            out.append(f"logical dim {name!r} has size {n}, not divisible by {k} ({sizes}), where strategy "
                       f"{self.strategy.name!r} shards it ({', '.join(roles)}: {at}); shards are even: choose mesh "
                       f"sizes that divide {n}, or map {name!r} to other axes")
        if out:
            raise ProgramError(headline, out)


def make_program(model: Model, strategy: Strategy | str, mesh: Mesh, *, batch: int,
                 optimizer: OptimizerConfig = OptimizerConfig(), model_ref: str | None = None,
                 fault: Fault | None = None, microbatches: int = 1, schedule: str | None = None,
                 virtual: int | None = None, remat: Remat | str = Remat.NONE,
                 precision: Precision | str = FP32, offload: bool = False, _stage: bool = False) -> Program:
    """Resolve and check every layout of ``model`` under ``strategy`` on ``mesh`` for batches of
    ``batch``, run as ``microbatches`` microbatches a step (gradient accumulation; with a
    pipeline axis, the pipeline's microbatches, in the order of ``schedule``, default 1f1b, with
    ``virtual`` stages a rank), each repeated layer's activations kept or recomputed as ``remat``
    says, computing in ``precision`` (fp32, bf16, fp16: core/precision.py), AdamW's states in
    host memory between steps where ``offload``; raises one
    ``ProgramError`` listing every problem. ``_stage``: the
    program of one pipeline stage's microbatch (the pipeline axis is the schedule's, not idle)."""
    model = check_model(model)
    strategy = load_strategy(strategy)
    remat = parse_remat(remat)
    precision = parse_precision(precision)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"make_program: mesh must be a parlay.Mesh, got {mesh!r}.")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive int.")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive int.")
    cut = [] if not batch % microbatches else [
        f"a step's batch is split into equal microbatches; {batch} is not divisible by {microbatches}: use a batch "
        f"of {batch - batch % microbatches or microbatches} or {batch - batch % microbatches + microbatches}, or a "
        f"microbatch count that divides {batch}"]
    headline = f"strategy {strategy.name!r} cannot run this model on {mesh} with batch {batch}:"
    problems = _Problems(mesh, strategy)
    missing = [a for a in strategy.axes if not mesh.has_axis(a)]
    if missing:
        raise ProgramError(headline, [f"strategy {strategy.name!r} uses mesh axes {list(strategy.axes)} but {mesh} "
                                      f"lacks {missing}; e.g. --mesh " + ",".join(f"{a}=2" for a in strategy.axes)])
    pp_axis = pipeline_axis(strategy)
    if pp_axis is not None and not _stage:  # the batch's, the schedule's and the layers' problems at once
        staged = pipeline_problems(model, mesh, pp_axis, schedule=schedule or "1f1b", microbatches=microbatches,
                                   virtual=virtual)
        if cut or staged:
            raise PipelineError(f"model {type(model).__name__} cannot be pipelined over {pp_axis}="
                                f"{mesh.axis_size(pp_axis)} with batch {batch} in {microbatches} microbatches:",
                                cut + staged)
    if cut:
        raise ProgramError(f"batch {batch} cannot be cut into {microbatches} microbatches:", cut)
    if pp_axis is not None and precision.loss_scale is not None:
        raise ProgramError(headline, [f"precision {precision.name!r} scales the loss dynamically, which the pipeline "
                                      f"schedules do not carry yet (every stage's backward would need the scale and "
                                      f"every rank the overflow check): use --precision bf16 (float32's exponent "
                                      f"range, no scaling) or fp32"])
    if schedule is not None and pp_axis is None and not _stage:
        raise ProgramError(headline, [f"schedule {getattr(schedule, 'value', schedule)!r} needs a pipeline: map the "
                                      f"model's layers to a mesh axis (add the strategy 'pp', e.g. --strategy pp+dp "
                                      f"with --mesh pp=2,dp=2)"])
    decls = tuple(model.decls())
    wrong = [d for d in decls if not isinstance(d, ParamDecl)]
    if wrong:
        raise ProgramError(headline, [f"decls() must give ParamDecl(name, shape, dims) for each parameter, got "
                                      f"{wrong[0]!r:.100}"])
    names = [d.name for d in decls]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ProgramError(headline, [f"the model declares parameter {dup[0]!r} twice; names must be unique"])
    inputs = model.inputs(batch)
    if not isinstance(inputs, Mapping) or not all(isinstance(d, InputDecl) for d in inputs.values()):
        raise ProgramError(headline, [f"inputs(batch) must give a mapping of input name to InputDecl(shape, dims, "
                                      f"dtype), got {inputs!r:.100}"])
    inputs = dict(inputs)
    for name, d in inputs.items():
        if d.shape[0] != batch:
            problems.add(f"input {name!r} has shape {d.shape} for batch {batch}; an input's first dim is the batch")
    tr = trace(model, batch)
    for problem in check_remat(model, remat):
        problems.add(problem)
    if tr.loss != ():
        problems.add(f"the loss has shape {tr.loss}; loss(ops, params, batch) must return a scalar (reduce it, e.g. "
                     f"with ops.mean or ops.cross_entropy)")
    declared = {d.name: d.dims for d in decls}
    for name, dims, _ in tr.params:
        if name in declared and dims != declared[name]:
            problems.add(f"parameter {name!r} is declared with dims {declared[name]} but used with {dims}; use the "
                         f"declared dims (the layouts are resolved from them)")
        elif name not in declared:
            problems.add(f"the model uses parameter {name!r}, which decls() does not declare")

    layouts: dict[Role, dict[str, Layout]] = {}
    for role in PARAM_ROLES:
        rules, out = strategy.rules(role), {}
        for d in decls:
            spec, probs = rules._resolve(d.name, d.dims, mesh)
            for p in probs:
                problems.add(f"{role.value}: {p}")
            if spec is not None and problems.check(repr(d.name), d.dims, d.shape, spec, role):
                out[d.name] = Layout(mesh, spec)
        layouts[role] = out
    act = strategy.rules(Role.ACTIVATIONS)
    layouts[Role.ACTIVATIONS] = {}
    for name, d in inputs.items():
        spec, probs = act._resolve(f"input {name!r}", d.dims, mesh)
        for p in probs:
            problems.add(p)
        if spec is not None and problems.check(f"input {name!r}", d.dims, d.shape, spec, Role.ACTIVATIONS):
            layouts[Role.ACTIVATIONS][name] = Layout(mesh, spec)
    activations: dict[tuple, Layout] = {}
    for dims, shape in dict.fromkeys(tr.constraints):
        spec, probs = act._resolve(f"activation {dims}", dims, mesh)
        for p in probs:
            problems.add(p)
        if spec is not None and problems.check(f"activation {dims} {shape}", dims, shape, spec, Role.ACTIVATIONS):
            activations[dims] = Layout(mesh, spec)

    # A rule that matches nothing is a typo or a strategy meant for another model.
    param_dims = {n for d in decls for n in d.dims if n is not None}
    act_dims = {n for d in inputs.values() for n in d.dims if n is not None} | \
               {n for dims, _ in tr.constraints for n in dims if n is not None}
    unmatched: dict[tuple, list[str]] = {}
    # A rule written once for parameters and activations alike (Flax's one list) needs a match in either.
    both = set(strategy.rules(Role.PARAMS).rules) & set(strategy.rules(Role.ACTIVATIONS).rules)
    for role in Role:
        for name, axes in strategy.rules(role).rules:
            vocab = (param_dims | act_dims if (name, axes) in both else
                     act_dims if role is Role.ACTIVATIONS else param_dims)
            if name not in vocab and name not in strategy.generic and not (name == LAYERS and pp_axis):
                roles = unmatched.setdefault((name, axes, role is Role.ACTIVATIONS), [])
                if role.value not in roles:
                    roles.append(role.value)
    for (name, axes, act), roles in unmatched.items():
        if act:
            where = (f"no input or constraint point (ops.constrain) has a dim named {name!r}; the activation dims "
                     f"are {sorted(act_dims)}")
        else:
            where = f"no parameter has a dim named {name!r}; the parameter dims are {sorted(param_dims)}"
        problems.add(f"rule ({name!r}, {_rule_text(axes)}) of strategy {strategy.name!r} ({', '.join(roles)}) matches "
                     f"no tensor: {where}; fix the name or drop the rule")
    # A mesh axis that shards nothing makes every rank along it compute the same thing.
    busy = {a for role in layouts.values() for l in role.values() for a in l.spec.axes} | \
           {a for l in activations.values() for a in l.spec.axes}
    batch_dims = sorted({d.dims[0] for d in inputs.values() if d.dims[0] is not None})
    for a in mesh.axis_names:
        if mesh.axis_size(a) == 1 or a in busy or problems.divisibility or a == pp_axis:
            continue
        naming = [f"({n!r}, {_rule_text(ax)})" for n, ax in dict.fromkeys(
            (n, ax) for role in Role for n, ax in strategy.rules(role).rules if a in ax)]
        batch_split = any(l.spec.dim_axes(0) for l in layouts[Role.ACTIVATIONS].values())
        hint = ("map a dim of a parameter, an input or a constraint point to it, or drop the axis" if batch_split else
                f"the model's batch dim is named {batch_dims or 'nothing'}: map it to {a!r} (a rule "
                f"({(batch_dims or ['batch'])[0]!r}, {a!r})), or drop the axis")
        why = f"its rules {', '.join(naming)} match no dim of the model; {hint}" if naming else hint
        problems.add(f"mesh axis {a!r} (size {mesh.axis_size(a)}) shards no tensor under strategy {strategy.name!r}, "
                     f"so every rank along it would compute the same thing; {why}")
    for problem in _check_zigzag(strategy, mesh, inputs, pp_axis):
        problems.add(problem)
    problems.raise_if_any(headline)
    pipeline = None
    if pp_axis is not None and not _stage:
        pipeline = make_pipeline(model, mesh, pp_axis, schedule=schedule or "1f1b", microbatches=microbatches,
                                 virtual=virtual, batch=batch)
    program = Program(model, strategy, mesh, batch, optimizer, model_ref, fault, decls, inputs, layouts, activations, tr,
                      microbatches, pipeline, remat, precision, bool(offload))
    if microbatches > 1:
        try:
            program.micro  # noqa: B018 (checks the microbatch's shapes against the layouts)
        except ProgramError as e:
            raise ProgramError(f"strategy {strategy.name!r} cannot run this model on {mesh} with batch {batch} in "
                               f"{microbatches} microbatches of {batch // microbatches}:", list(e.problems) + [
                                   f"a microbatch holds {batch // microbatches} of the batch's {batch} examples and "
                                   f"must still split over the axes above: use fewer microbatches or a larger "
                                   f"batch"]) from None
    return program


def _check_zigzag(strategy: Strategy, mesh: Mesh, inputs: Mapping[str, InputDecl], pp_axis) -> list[str]:
    """What keeps ``strategy.zigzag`` from laying the sequence out in zigzag order."""
    axes = strategy.zigzag
    if not axes:
        return []
    missing = [a for a in axes if not mesh.has_axis(a)]
    if missing:
        return [f"strategy {strategy.name!r} lays the sequence out zigzag over {list(axes)}, but {mesh} has no axis "
                f"{missing[0]!r}; add it (e.g. --mesh {missing[0]}=2) or put the strategy on your axis "
                f"({strategy.name.split('+')[0]}@NAME)"]
    n = mesh.group_size(axes)
    seqs = {d.shape[seq_dim(d.dims)] for d in inputs.values() if seq_dim(d.dims) is not None}
    out = []
    if not seqs:
        out.append(f"strategy {strategy.name!r} lays the sequence out zigzag, but no input has a dim named "
                   f"{' or '.join(map(repr, SEQ_DIMS))} (the inputs' dims: "
                   f"{sorted({str(x) for d in inputs.values() for x in d.dims if x})}); name the sequence dim of "
                   f"the inputs so, or use ring_contiguous")
    elif len(seqs) > 1:
        out.append(f"the inputs' sequence dims have different lengths {sorted(seqs)}; zigzag needs one sequence")
    elif next(iter(seqs)) % (2 * n):
        s = next(iter(seqs))
        out.append(f"zigzag over {list(axes)} ({n} ranks) splits the sequence into {2 * n} chunks, but it has {s} "
                   f"positions; use a sequence divisible by {2 * n}, or ring_contiguous")
    if pp_axis is not None:
        out.append(f"zigzag (strategy {strategy.name!r}) and a pipeline do not combine yet; use ring_contiguous with "
                   f"pp, or no pipeline")
    return out


def program_from(model_ref: str, strategy_ref: str, mesh: Mesh, *, batch: int,
                 optimizer: OptimizerConfig = OptimizerConfig(), fault: Fault | None = None,
                 microbatches: int = 1, schedule: str | None = None, virtual: int | None = None,
                 remat: Remat | str = Remat.NONE, precision: Precision | str = FP32,
                 offload: bool = False) -> Program:
    """``make_program`` from references: a preset or FILE.py:NAME / module:NAME, and built-in
    strategy names or FILE.py:NAME references joined by '+' (the command line's --model and
    --strategy); the program keeps the model's reference, to rebuild it elsewhere."""
    from .loading import load_model

    model, ref = load_model(model_ref)
    return make_program(model, load_strategy(strategy_ref), mesh, batch=batch, optimizer=optimizer,
                        model_ref=ref or model_ref, fault=fault, microbatches=microbatches, schedule=schedule,
                        virtual=virtual, remat=remat, precision=precision, offload=offload)
