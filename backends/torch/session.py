"""The torch backend's ``Session``: one process per rank (gloo here, NCCL under torchrun), or one
process for the whole model (the reference).

A sharded session holds this rank's parameter blocks (a ``torch.nn.Module`` whose parameters are
the stored shards, named as the model declares them), runs the model through the core executor
on ``TorchComm``, and takes AdamW steps on the optimizer layout's shards: gradients come out of
backward in the parameters' layouts (ZeRO-2: reduce-scattered straight into their shards), move to
the optimizer layout, torch's AdamW (or parlay's fused kernel on CUDA) updates them, and a core
plan moves the values back (ZeRO's all-gather).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Mapping

import numpy as np
import torch

from ...core import Layout, plan_redistribute
from ...core.executor import Hooks
from ...core.log import CollectiveLog, Source, layer_of
from ...core.ops import DenseOps, DropoutKey
from ...core.optim import OptimizerConfig
from ...core.pieces import owned_blocks, pieces_of, rank_file
from ...core.pipeline import run_pipeline
from ...core.precision import LossScale
from ...core.program import Program
from ...core.remat import remat_loss
from ...core.session import check_batch, make_executor, microbatches, scalar_loss, sharded_inputs, sharded_params
from ...core.steps import Kind
from ...core.strategies import Role
from ...core.trace import Recorder, assemble, check_step
from .collectives import run_plan
from .comm import TorchComm
from .grad_sync import GradSync
from .launch import mark_progress, spawn, stop_all
from .mesh import TorchMesh
from .ops import TorchLocal
from .pipeline import P2P, TorchStages
from .remat import torch_checkpoint

__all__ = ["TorchBackend", "TorchSession", "TorchSingleSession", "ShardedModule", "GLOO_PER_CORE"]

GLOO_PER_CORE = 16  # gloo processes per CPU core this machine runs in reasonable time


class TorchBackend:
    """``bucket_bytes``: data-parallel gradient sums go in buckets of this size that overlap the
    backward pass (None: one blocking all-reduce per parameter, as the variance rule says).
    ``coalesce``: parameters gathered for use (FSDP) are gathered one block at a time in one
    collective, and their gradients reduce-scattered likewise. ``kernels``: the Triton switch."""

    def __init__(self, name: str = "torch", single: bool = False, *, bucket_bytes: int | None = 25 * 2**20,
                 coalesce: bool = True, kernels: str | None = None):
        self.name, self.single = name, single
        self.options = dict(bucket_bytes=bucket_bytes, coalesce=coalesce, kernels=kernels)

    def prepare(self, mesh) -> None:
        import os

        limit = (os.cpu_count() or 1) * GLOO_PER_CORE
        if not self.single and mesh.size > limit:
            raise ValueError(f"{mesh} has {mesh.size} ranks; this machine runs at most {limit} gloo processes "
                             f"({GLOO_PER_CORE} per core).")

    def run(self, program: Program, fn: Callable, *args, params=None, seed: int = 0, on_event=None,
            timeout_s: float = 600.0, wall_s: float | None = -1):
        self.prepare(program.mesh)
        _refuse_offloaded_pipeline(program)
        pipe = program.pipeline
        if program.remat.value == "selective" and pipe is not None and pipe.schedule.splits_backward:
            raise ValueError(f"--remat selective on torch keeps its saved values for one backward of each layer, and "
                             f"{pipe.schedule.name} runs two (the input gradient, then the weights'): use --remat "
                             f"block, or a schedule that does not split the backward (1f1b, interleaved, gpipe)")
        if self.single:
            session = TorchSingleSession(program, program.init(seed) if params is None else params, seed=seed,
                                         emit=on_event, kernels=self.options["kernels"])
            return fn(session, *args)
        import multiprocessing as mp

        events = mp.get_context("spawn").Queue() if on_event is not None else None
        launch = lambda: spawn(_worker, program.mesh.size, program, fn, args, params, seed, events, self.options,
                               timeout_s=timeout_s, wall_s=None if on_event is not None else wall_s)[0]
        if events is None:
            return launch()
        return _relay(launch, events, on_event)


def _worker(rank, program: Program, fn, args, params, seed, events, options):
    emit = events.put if events is not None and rank == 0 else None
    session = TorchSession(program, program.init(seed) if params is None else params, seed=seed, emit=emit,
                           **options)
    out = fn(session, *args)
    if emit is not None:  # flush the events into the pipe before spawn may stop this process
        events.close()
        events.join_thread()
    return out if rank == 0 else None


def _relay(launch: Callable, events, on_event: Callable):
    """Run ``launch`` (it spawns the ranks) in a thread; hand rank 0's events to ``on_event`` here."""
    result, failure = [], []

    def run():
        try:
            result.append(launch())
        except BaseException as e:
            failure.append(e)
        finally:
            events.put(_DONE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while True:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive():  # the sentinel may never come if a rank died mid-put
                    break
                continue
            if isinstance(event, str) and event == _DONE:
                break
            on_event(event)
    except BaseException:  # SIGINT/SIGTERM here, or on_event raised: no rank outlives the run
        stop_all()
        thread.join(timeout=10)
        raise
    thread.join()
    events.cancel_join_thread()
    if failure:
        raise failure[0]
    return result[0] if result else None


_DONE = "parlay:done"


# -- the optimizer, shared by both sessions ------------------------------------------------------------

def _adamw(params, cfg: OptimizerConfig, fused: bool = False) -> torch.optim.AdamW:
    """``fused``: torch's fused AdamW (on host tensors: its vectorised, multi-threaded CPU kernel,
    what the offloaded update runs)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


def _refuse_offloaded_pipeline(program: Program) -> None:
    if program.offload and program.pipeline is not None:
        raise ValueError("--offload is built for steps without a pipeline so far (a stage's states stay on its "
                         "device): drop --offload or the pp strategy")


def _on_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    t = t.detach().to("cpu", copy=True)
    return t.pin_memory() if pin else t


def _clip(norm: torch.Tensor, clip: float) -> torch.Tensor:
    # optax.clip_by_global_norm's rule, so torch and JAX trajectories can be compared.
    return torch.where(norm < clip, torch.ones_like(norm), clip / norm)


def _adamw_step(opt: torch.optim.AdamW, cfg: OptimizerConfig, updates: int) -> int:
    """One AdamW update at the schedule's rate for update ``updates``; returns the new count.
    Where the kernel switch says Triton (by default: CUDA tensors), parlay's fused multi-tensor
    kernel takes the step on the optimizer's own state (so checkpoints see the same state)."""
    from ...triton_kernels import adamw_step, should_use_triton

    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    lr = cfg.lr_at(updates)
    if params and should_use_triton(None, *params, *(p.grad for p in params)):
        for p in params:
            state = opt.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
        with torch.no_grad():
            adamw_step(params, [p.grad for p in params], [opt.state[p]["exp_avg"] for p in params],
                       [opt.state[p]["exp_avg_sq"] for p in params], step=updates + 1, lr=lr, beta1=cfg.beta1,
                       beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
        return updates + 1
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    return updates + 1


# fp16's dynamic loss scale (core/precision.py), for both sessions: the backward's seed is the
# scale over the microbatch count; the step unscales in the clipping factor, and a step whose
# gradients are not all finite is skipped (every rank has the same all-reduced norm, so all skip).
def _seed(scaler: LossScale | None, parts: int) -> float:
    return (1.0 if scaler is None else scaler.scale) / parts


def _unscale(scaler: LossScale | None) -> float:
    return 1.0 if scaler is None else scaler.scale


def _norm(scaler: LossScale | None, sq: torch.Tensor) -> torch.Tensor:
    """The global norm of the true (unscaled) gradients from their scaled squares' sum."""
    return (torch.sqrt(sq) / _unscale(scaler)).float()


def _skip(scaler: LossScale | None, sq: torch.Tensor) -> bool:
    """Whether to skip the step (fp16 overflowed; the scale backs off). Without a scaler, never."""
    return scaler is not None and not scaler.update(bool(torch.isfinite(sq)))


def _torch_batch(program: Program, batch, device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v, device=device) for k, v in check_batch(program, batch).items()}


# -- one process: the reference -------------------------------------------------------------------------

class TorchSingleSession:
    """Single-process AdamW on the neutral model: the reference for the sharded session."""

    rank, lead = 0, True

    def __init__(self, program: Program, params: Mapping[str, np.ndarray], *, seed: int = 0, emit=None,
                 kernels: str | None = None):
        self.program, self.seed, self._emit, self.count = program, seed, emit, 0
        self.local_ops = TorchLocal(kernels=kernels)
        self.params_ = {k: torch.tensor(np.asarray(params[k], np.float32), requires_grad=True) for k in program.shapes}
        self.opt = _adamw(list(self.params_.values()), program.optimizer)
        self.scaler = LossScale.of(program.precision)  # fp16's dynamic loss scale (None: no scaling)

    def _loss(self, batch, *, training: bool, wrap=None, program: Program | None = None, rows=(1, 0)):
        p = self.program if program is None else program
        ops = DenseOps(self.local_ops, training=training, rng=DropoutKey(self.seed, self.count, rows=rows),
                       dtype=p.precision.dtype)
        if wrap:
            return p.model.loss(wrap(ops), self.params_, _torch_batch(p, batch, "cpu"))
        return remat_loss(p.model, p.remat, ops, self.params_, _torch_batch(p, batch, "cpu"),
                          torch_checkpoint(p.remat) if training else None)

    def _accumulate(self, batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        parts = microbatches(self.program, batch)
        total = 0.0
        for arrays, rows in parts:
            loss = self._loss(arrays, training=True, program=self.program.micro, rows=rows)
            (loss * _seed(self.scaler, len(parts))).backward()
            total += float(loss.detach()) / len(parts)
        return total

    def step(self, batch) -> float:
        loss = self._accumulate(batch)
        with torch.no_grad():
            sq = sum((p.grad.double() ** 2).sum() for p in self.params_.values())
            if _skip(self.scaler, sq):
                return loss
            scale = _clip(_norm(self.scaler, sq), self.program.optimizer.clip) / _unscale(self.scaler)
            for p in self.params_.values():
                p.grad.mul_(scale)
        self.count = _adamw_step(self.opt, self.program.optimizer, self.count)
        return loss

    def eval_loss(self, batch) -> float:
        with torch.no_grad():
            return float(self._loss(batch, training=False))

    def loss_and_grads(self, batch):
        loss = self._accumulate(batch)
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)).numpy() / np.float32(_unscale(self.scaler))
                 for k, v in self.params_.items()}
        self.opt.zero_grad(set_to_none=True)
        return loss, grads

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in self.params_.items()}

    def checkpoint_tensors(self):
        raise ValueError("checkpoints are saved from a sharded run, not the single-process reference.")

    def restore(self, ckpt, params_only: bool = False) -> None:
        raise ValueError("restore into a sharded run, not the single-process reference.")

    def trace(self, batch) -> list:
        holder = {}

        def wrap(ops):
            holder["rec"] = Recorder(ops, lambda probe, out: setattr(probe, "value", _numpy(out)))
            return holder["rec"]

        with torch.no_grad():
            self._loss(batch, training=False, wrap=wrap)
        return holder["rec"].probes

    def barrier(self) -> None:
        pass

    def emit(self, event) -> None:
        if self._emit is not None:
            self._emit(event)


# -- one rank of a mesh -------------------------------------------------------------------------------------

def _assemble(local: torch.Tensor, layout: Layout, shape) -> np.ndarray:
    """The global array from every rank's block of ``layout`` (a collective: every rank calls it).
    Ranks holding the same block must hold the same bits (``core.sim.gather``): a gradient whose
    replicas differ is a variance bug, refused here as on the numpy backend."""
    from ...core.sim import gather

    try:
        return gather(_blocks(local, layout.mesh.size), layout)
    except ValueError as e:
        raise AssertionError(f"the replicas of a tensor of shape {tuple(shape)} in {layout} differ: {e}") from None


def _blocks(local: torch.Tensor, world: int) -> list[np.ndarray]:
    import torch.distributed as dist

    mark_progress()
    local = local.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local)
    return [_numpy(p) for p in pieces]


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor on the host as numpy (a 16-bit float widened to float32: numpy has no bfloat16)."""
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy().copy()


class ShardedModule(torch.nn.Module):
    """This rank's stored parameter blocks as a ``torch.nn.Module``, named as the model declares
    them (``blocks.0.attn.wq`` lives in nested modules ``blocks.0.attn``): ``module(batch)`` is the
    loss, and a plain ``loss.backward()`` leaves every gradient summed (the buckets finish when
    autograd does); ZeRO-2's sharded gradients are in ``session.grads()``."""

    def __init__(self, session: "TorchSession", blocks: Mapping[str, torch.Tensor]):
        super().__init__()
        self._session = [session]  # not a submodule
        for name, tensor in blocks.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(tensor.detach()))

    def forward(self, batch) -> torch.Tensor:
        return self._session[0].loss(batch)


class TorchSession:
    """One rank of a sharded run (torch.distributed initialised: by ``spawn`` or torchrun)."""

    def __init__(self, program: Program, params: Mapping[str, np.ndarray], *, seed: int = 0, emit=None,
                 bucket_bytes: int | None = 25 * 2**20, coalesce: bool = True, kernels: str | None = None,
                 device: str | None = None):
        import torch.distributed as dist

        # A layer recomputed under remat must run the same ops again: no block gathered at its first
        # use and handed out later (the recompute would find it spent), each parameter at its use.
        coalesce = coalesce and program.remat.value == "none"
        self.program, self.seed, self._emit, self.coalesce = program, seed, emit, coalesce
        mesh, lay = program.mesh, program.layouts
        if device is None:
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
        self.device = torch.device(device)
        self.tm = TorchMesh(mesh, self.device.type, local_groups=program.pipeline is not None)
        self.rank = self.tm.rank
        self.lead = self.rank == 0
        self.log = CollectiveLog()
        self.local_ops = TorchLocal(kernels=kernels, device=self.device)
        self.grad_sync = (GradSync(self.tm, bucket_bytes=bucket_bytes, log=self.log, grad_layouts=lay[Role.GRADS])
                          if bucket_bytes else None)
        pipe = program.pipeline
        # Under a pipeline this rank holds (and updates) only the parameters its stages use.
        self.pp_rank = mesh.coord(self.rank, pipe.axis) if pipe is not None else None
        self.owned = (pipe.params_of_rank(self.pp_rank) if pipe is not None else frozenset(program.shapes))
        self.module = ShardedModule(self, self._shard(params, Role.PARAMS))
        self.local = dict(self.module.named_parameters())
        # Where the optimizer layout is the parameter's own, AdamW steps the parameter in place;
        # elsewhere (ZeRO) it steps a shard of it. Under offload every master is a host copy of
        # the optimizer's shard, stepped there by torch's fused CPU AdamW.
        self.offload = program.offload
        _refuse_offloaded_pipeline(program)
        self.host = torch.device("cpu")
        pin = self.device.type == "cuda"  # page-locked: the copies are asynchronous DMA
        self.shared = set() if self.offload else {k for k in self.owned if lay[Role.OPTIMIZER][k] == lay[Role.PARAMS][k]}
        self.master = {k: self.local[k] if k in self.shared else
                       (_on_host(t, pin) if self.offload else t).requires_grad_(True)
                       for k, t in self._shard(params, Role.OPTIMIZER).items()}
        self.host_grads = {k: _on_host(torch.zeros_like(m), pin) for k, m in self.master.items()} if self.offload else {}
        self.opt = _adamw(list(self.master.values()), program.optimizer, fused=self.offload)
        self.scaler = LossScale.of(program.precision)  # fp16's dynamic loss scale (None: no scaling)
        self.count = 0
        self.hooks: Hooks | None = None  # observers of the next forward (tests, the bisect)

    def _shard(self, params, role: Role) -> dict[str, torch.Tensor]:
        lay = self.program.layouts[role]
        return {k: torch.tensor(np.ascontiguousarray(np.asarray(params[k], np.float32)[
            lay[k].shard_slices(np.shape(params[k]))[self.rank]]), device=self.device) for k in self.program.shapes
            if k in self.owned}

    # -- forward and backward -----------------------------------------------------------------------------
    def loss(self, batch, *, training: bool = True, wrap=None, program: Program | None = None, rows=(1, 0),
             accumulate: bool = False) -> torch.Tensor:
        """This rank's loss (the same on every rank) of a batch of ``program`` (default: the
        session's); ``wrap(ops)`` wraps the executor. ``accumulate``: the next backward adds to the
        gradients the last one left (a microbatch of a step), rather than starting anew."""
        p = self.program if program is None else program
        comm = TorchComm(self.tm, self.local_ops, log=self.log, grad_sync=self.grad_sync)
        place = lambda x, layout: torch.as_tensor(np.ascontiguousarray(x[layout.shard_slices(x.shape)[self.rank]]),
                                                  device=self.device)
        sp = sharded_params(p, self.local)
        sb = sharded_inputs(p, batch, place)
        hooks, self.hooks = self.hooks, None
        if self.grad_sync is not None and torch.is_grad_enabled() and not accumulate:
            self.grad_sync.sharded.clear()  # a new forward: the last backward's sharded gradients are spent
        ops = make_executor(p, comm, sp, coalesce=self.coalesce, hooks=hooks, training=training, step=self.count,
                            seed=self.seed, rows=rows)
        if wrap is not None:
            return scalar_loss(ops, p.model.loss(wrap(ops), sp, sb))
        checkpoint = torch_checkpoint(p.remat) if training and torch.is_grad_enabled() else None
        return scalar_loss(ops, remat_loss(p.model, p.remat, ops, sp, sb, checkpoint))

    def _accumulate(self, batch) -> float:
        """Forward and backward of a step's microbatches, each loss weighted 1/k before its
        backward (``core.session.microbatches``); the gradients add up in place. The mean loss.
        Under a pipeline: this rank's actions of the schedule (``core.pipeline.run_pipeline``)."""
        parts = microbatches(self.program, batch)
        for p in self.local.values():
            p.grad = None
        if self.grad_sync is not None:
            self.grad_sync.sharded.clear()
        if self.program.pipeline is not None:
            return self._run_pipeline(parts)
        total = 0.0
        for i, (arrays, rows) in enumerate(parts):
            if self.grad_sync is not None:  # the step's sums wait for its last microbatch
                self.grad_sync.defer = i < len(parts) - 1
            loss = self.loss(arrays, program=self.program.micro, rows=rows, accumulate=True)
            self.backward(loss * _seed(self.scaler, len(parts)))
            total += float(loss.detach()) / len(parts)
        if self.grad_sync is not None:
            self.grad_sync.release()
        return total

    def _run_pipeline(self, parts) -> float:
        import torch.distributed as dist

        pipe = self.program.pipeline
        transport = P2P(self)
        self.timeline = {}  # this step's (start, end, action) per compute action (benchmarks read it)
        self.timeline_start = time.perf_counter()
        losses = run_pipeline(pipe, {self.pp_rank: TorchStages(self, parts)}, transport, timeline=self.timeline,
                              clock=time.perf_counter)[self.pp_rank]
        transport.finish()
        self.timeline_end = time.perf_counter()
        if self.grad_sync is not None:
            self.grad_sync.release()
        self._sum_shared_grads()
        # The last stage's rank has the losses; every rank returns their mean.
        mean = torch.tensor(sum(losses) / len(parts) if losses else 0.0, dtype=torch.float64, device=self.device)
        mark_progress()
        dist.all_reduce(mean, group=self.tm.group((pipe.axis,))[0])
        return float(mean)

    def _sum_shared_grads(self) -> None:
        """A parameter held by several pp ranks (a tied table on the first and last stage) gets
        the sum of their gradients: an all-reduce over pp, the ranks that do not hold it adding
        zeros. The same order on every rank."""
        import torch.distributed as dist

        pipe, lay = self.program.pipeline, self.program.layouts
        sharded = self.grad_sync.sharded if self.grad_sync is not None else {}
        group = self.tm.group((pipe.axis,))[0]
        sharded_names = self._sharded_grads()
        for k in pipe.shared_params:
            into_sharded = k in sharded_names
            layout = lay[Role.GRADS][k] if into_sharded else lay[Role.PARAMS][k]
            if k in self.local:
                g, held_in = self.grads()[k]
                assert held_in == layout, (k, held_in, layout)  # every rank must send the same shape
                g = g.clone()
            else:
                g = torch.zeros(layout.local_shape(self.program.shapes[k]), device=self.device)
            mark_progress()
            dist.all_reduce(g, group=group)
            self.log.record(Kind.ALL_REDUCE, (pipe.axis,), g.numel() * g.element_size(), True, Source.OP, g.dtype,
                            layer_of(k), k)
            if k in self.local:
                if into_sharded:
                    sharded[k], self.local[k].grad = g, None
                else:
                    self.local[k].grad = g

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then wait for the bucketed gradient sums."""
        loss.backward()
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def grads(self) -> dict[str, tuple[torch.Tensor, Layout]]:
        """This rank's gradient of each parameter and the layout it is in (ZeRO-2: sharded)."""
        lay = self.program.layouts
        sharded = self.grad_sync.sharded if self.grad_sync is not None else {}
        out = {}
        for k, v in self.local.items():
            if k not in sharded:
                out[k] = (v.grad if v.grad is not None else torch.zeros_like(v), lay[Role.PARAMS][k])
                continue
            g = sharded[k]
            if v.grad is not None:  # another use (a tied table used after a slice) reached autograd's gradient
                with torch.no_grad():
                    g = g + self._move(k, v.grad, lay[Role.PARAMS][k], lay[Role.GRADS][k])
            out[k] = (g, lay[Role.GRADS][k])
        return out

    def _move(self, name: str, x: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
        plan = plan_redistribute(src, dst, self.program.shapes[name], itemsize=x.element_size())
        return run_plan(plan, x, self.tm, self.log)

    # -- the Session contract --------------------------------------------------------------------------------
    def step(self, batch) -> float:
        import torch.distributed as dist

        mark_progress()
        self.log.clear()  # the collectives of this step only (a long run would grow it)
        loss = self._accumulate(batch)
        mesh, lay, cfg = self.program.mesh, self.program.layouts, self.program.optimizer
        pipe = self.program.pipeline
        with torch.no_grad():
            # The global norm counts each element once: a replicated shard is divided by its copies.
            sq = torch.zeros((), dtype=torch.float64, device=self.device)
            grads = self.grads()
            for k, m in self.master.items():
                g, layout = grads[k]
                if k not in self.shared or layout != lay[Role.OPTIMIZER][k]:
                    # the optimizer's own shard (ZeRO), or a gradient that went to its own layout
                    g = self._move(k, g, layout, lay[Role.OPTIMIZER][k])
                    if self.offload:  # to the host, asynchronously (pinned buffers on CUDA)
                        m.grad = self.host_grads[k].copy_(g, non_blocking=True)
                    else:
                        m.grad = g.clone()
                else:
                    g = m.grad
                opt_layout = lay[Role.OPTIMIZER][k]
                # the ranks holding this parameter: a pp rank's share, times the pp ranks sharing it
                holders = mesh.size if pipe is None else mesh.size // mesh.axis_size(pipe.axis) * len(
                    pipe.ranks_of_param(k))
                copies = holders // int(np.prod([opt_layout.shard_count(d) for d in range(m.ndim)]))
                sq += torch.dot(g.reshape(-1), g.reshape(-1)).double() / copies
            mark_progress()
            dist.all_reduce(sq)
            if self.offload and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the gradients are on the host
            if _skip(self.scaler, sq):
                return loss
            scale = _clip(_norm(self.scaler, sq), cfg.clip) / _unscale(self.scaler)
            for m in self.master.values():
                m.grad.mul_(scale)
        self.count = _adamw_step(self.opt, cfg, self.count)
        with torch.no_grad():
            for k, m in self.master.items():
                if k not in self.shared:  # (offload: the updated master back to the device first)
                    self.local[k].copy_(self._move(k, m.detach().to(self.device, non_blocking=True),
                                                   lay[Role.OPTIMIZER][k], lay[Role.PARAMS][k]))
        return loss

    def eval_loss(self, batch) -> float:
        if self.program.pipeline is not None:
            return self._pipeline_eval(batch)
        with torch.no_grad():
            return float(self.loss(batch, training=False))

    def _pipeline_eval(self, batch) -> float:
        """The loss alone under a pipeline: every microbatch through the stages in order, each
        stage on its rank, values passed on as they are made (no backward, so no schedule)."""
        import torch.distributed as dist

        pipe = self.program.pipeline
        parts = microbatches(self.program, batch)
        stages, transport, total = TorchStages(self, parts, training=False), P2P(self), 0.0
        sched = pipe.schedule
        with torch.no_grad():
            for j in range(len(parts)):
                x = None
                for s in range(pipe.stages):
                    if sched.rank_of(s) != self.pp_rank:
                        continue
                    if s > 0 and sched.rank_of(s - 1) != self.pp_rank:
                        x = transport.exchange(self.pp_rank, [], [(("F", s, j), sched.rank_of(s - 1))])[("F", s, j)]
                    y, _ = stages.forward(s, j, x)
                    if s == pipe.stages - 1:
                        total += y / len(parts)
                    elif sched.rank_of(s + 1) != self.pp_rank:
                        transport.exchange(self.pp_rank, [(("F", s + 1, j), sched.rank_of(s + 1), y)], [])
                    x = y
        transport.finish()
        mean = torch.tensor(total, dtype=torch.float64, device=self.device)
        mark_progress()
        dist.all_reduce(mean, group=self.tm.group((pipe.axis,))[0])
        return float(mean)

    def loss_and_grads(self, batch):
        loss = self._accumulate(batch)
        shapes, lay, mine = self.program.shapes, self.program.layouts, self.grads()
        layout_of = lambda k: mine[k][1] if k in mine else (lay[Role.GRADS][k] if k in self._sharded_grads()
                                                             else lay[Role.PARAMS][k])
        grads = {k: self._gather(k, mine[k][0] if k in mine else None, layout_of(k)) for k in shapes}
        if self.scaler is not None:
            grads = {k: None if g is None else g / np.float32(self.scaler.scale) for k, g in grads.items()}
        for p in self.local.values():
            p.grad = None
        return loss, grads

    def params(self) -> dict[str, np.ndarray]:
        lay = self.program.layouts[Role.PARAMS]
        return {k: self._gather(k, self.local[k].detach() if k in self.local else None, lay[k])
                for k in self.program.shapes}

    def _sharded_grads(self) -> set:
        """The parameters whose gradients go to their own layout (ZeRO-2), on every rank alike."""
        lay = self.program.layouts
        return {k for k in self.program.shapes if self.grad_sync is not None and lay[Role.GRADS][k] != lay[Role.PARAMS][k]}

    def _gather(self, name: str, local: torch.Tensor | None, layout: Layout) -> np.ndarray:
        """The global array of a tensor every rank holds a block of, or (under a pipeline) the
        ranks of one pp rank do: the others' blocks are taken from the holder with their other
        coordinates."""
        shape = self.program.shapes[name]
        pipe = self.program.pipeline
        if pipe is None:
            return _assemble(local, layout, shape)
        from ...core.sim import gather

        if local is None:
            local = torch.zeros(layout.local_shape(shape), device=self.device)
        blocks = _blocks(local, self.program.mesh.size)
        mesh, owner = self.program.mesh, pipe.rank_of_param(name)
        blocks = [blocks[mesh.rank({**mesh.coords(r), pipe.axis: owner})] for r in range(mesh.size)]
        return gather(blocks, layout)

    def barrier(self) -> None:
        import torch.distributed as dist

        mark_progress()
        dist.barrier()

    def emit(self, event) -> None:
        if self._emit is not None:
            self._emit(event)

    # -- checkpoints: each rank writes the blocks it is the first holder of, reads what it needs -------------
    def _named(self):
        """(checkpoint name, this rank's tensor, layout) of every parameter and AdamW moment."""
        lay = self.program.layouts
        out = [(f"params/{k}", v.detach(), lay[Role.PARAMS][k]) for k, v in self.local.items()]
        for k, m in self.master.items():
            state = self.opt.state.get(m, {})
            for kind, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                out.append((f"opt/{kind}/{k}", state.get(key, torch.zeros_like(m)).detach(), lay[Role.OPTIMIZER][k]))
        return out

    def checkpoint_tensors(self):
        """Every rank computes the same ``tensors`` (from the layouts alone); ``blocks`` holds this
        rank's file only. Under a pipeline a stage's parameters (and their AdamW moments) are
        written by the ranks of the pp rank that holds them."""
        lay, shapes, pipe = self.program.layouts, self.program.shapes, self.program.pipeline
        values = {name: value for name, value, _ in self._named()}
        named = [(f"params/{k}", lay[Role.PARAMS][k]) for k in shapes]
        named += [(f"opt/{kind}/{k}", lay[Role.OPTIMIZER][k]) for k in shapes for kind in ("mu", "nu")]
        mesh = self.program.mesh
        tensors, mine = [], {}
        for name, layout in named:
            k = name.rsplit("/", 1)[1]
            holders = None if pipe is None else {
                r for r in range(mesh.size) if mesh.coord(r, pipe.axis) == pipe.rank_of_param(k)}
            tensors.append((name, tuple(shapes[k]), str(layout), pieces_of(name, layout, shapes[k], holders)))
            if name in values:
                for piece in owned_blocks(name, layout, shapes[k], self.rank, holders):
                    mine[piece.key] = values[name].cpu().numpy()
        return tensors, ({rank_file(self.rank): mine} if mine else {}), self.count

    def restore(self, ckpt, params_only: bool = False) -> None:
        """This rank reads only its blocks. ``params_only``: a fresh optimizer."""
        lay, shapes = self.program.layouts, self.program.shapes
        count = 0 if params_only else ckpt.count()

        def block(name, layout, shape, device=self.device):
            region = layout.shard_slices(tuple(shape))[self.rank]
            return torch.from_numpy(ckpt.read(name, region, shape=shape)).to(device)

        with torch.no_grad():
            for k, p in self.local.items():
                p.copy_(block(f"params/{k}", lay[Role.PARAMS][k], shapes[k]))
            for k, m in self.master.items():
                shape, layout = shapes[k], lay[Role.OPTIMIZER][k]
                if k not in self.shared:
                    m.copy_(block(f"params/{k}", layout, shape, m.device))
                if params_only:
                    self.opt.state.pop(m, None)
                    continue
                self.opt.state[m] = {"step": torch.tensor(float(count)),
                                     "exp_avg": block(f"opt/mu/{k}", layout, shape, m.device),
                                     "exp_avg_sq": block(f"opt/nu/{k}", layout, shape, m.device)}
        self.count = count

    # -- the bisect's recording: every op and plan step gathered to every rank -------------------------------
    def trace(self, batch) -> list:
        if self.program.pipeline is not None:
            raise ValueError("the bisect records one forward on every rank; under a pipeline each rank runs its own "
                             "stages, which it does not follow yet. Bisect the same strategy without pp.")
        world = self.program.mesh.size
        holder: dict = {}

        def capture(probe, out):
            probe.layout = out.layout
            probe.pieces = dict(enumerate(_blocks(out.local, world)))
            assemble(probe, world)

        def on_step(probe, plan, i, before, after):
            probe.steps.append(check_step(plan, i, _blocks(before, world), _blocks(after, world)))

        def wrap(ops):
            holder["rec"] = Recorder(ops, capture, on_step)
            return holder["rec"]

        with torch.no_grad():
            self.loss(batch, training=False, wrap=wrap)
        return holder["rec"].probes + holder["rec"].outside if self.lead else None
