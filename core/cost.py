"""A step's time from what it computes and sends, on a hardware profile: ``parlay plan --profile``.

The model is the alpha-beta one, per device, with nothing overlapped:

- compute: the step's matrix-product FLOPs at the profile's peak for the compute dtype times its
  ``efficiency``, plus every other op's written bytes, read and written once, at memory bandwidth.
  On a ``fused`` profile (the GPUs) an op that parlay's torch backend runs as one kernel there (the
  Triton norms and flash attention, torch's one-kernel activations and softmax) writes only what
  leaves it; elsewhere (the CPU profile, fitted to unfused counts) every traced op writes its
  outputs (``Written``);
- each collective: ``steps * latency + bytes / bandwidth`` (a ring's steps: n-1 for an all-gather,
  a reduce-scatter or an all-to-all, 2(n-1) for an all-reduce, 1 for a permute), over the
  intra-node link if its group stays inside one node and the inter-node link if it crosses one
  (ranks are numbered row-major over the mesh axes and fill nodes of ``node_devices`` in order);
- the optimizer: AdamW reads and writes its shard's parameters, gradients and two moments.

Profiles whose devices share one machine (``shared``: the fake JAX devices of a CPU host) run all
devices' compute on the same cores, so a step costs the devices' compute summed, not one's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .mesh import Mesh
from .steps import Kind

__all__ = ["Profile", "PROFILES", "StepTime", "Written", "step_time", "comm_time", "crosses_nodes"]


class Written(NamedTuple):
    """The bytes one device's ops other than matrix products write in a step, counted two ways."""

    ops: int  # every op writes its outputs
    kernels: int  # an op that is one kernel on a GPU writes only what leaves it (backends/jax/memory.py)

    def on(self, profile: "Profile") -> int:
        return self.kernels if profile.fused else self.ops


@dataclass(frozen=True)
class Profile:
    name: str
    flops: dict  # peak FLOP/s of one device's matrix products by compute dtype ("float32", "bfloat16", "float16")
    memory_bw: float  # bytes/s between a device and its memory
    intra_bw: float  # bytes/s one device sends over the link inside a node
    intra_latency: float  # seconds per step of a collective inside a node
    inter_bw: float  # bytes/s one device sends to another node
    inter_latency: float
    node_devices: int  # devices per node
    memory: float = 0.0  # bytes of one device's memory, what a layout must fit in (0: not given)
    efficiency: float = 0.5  # the share of peak FLOP/s matrix products reach (the GPUs: measured, below)
    shared: bool = False  # every device runs on the same cores (a CPU host's fake devices)
    per_collective: bool = False  # the latency is paid once a collective (not once a ring step)
    fused: bool = False  # ops that are one kernel here write only what leaves them (``Written.kernels``)
    bucket_bytes: int = 25 * 2 ** 20  # parameters' gradient sums are joined in buckets of this size
    source: str = ""  # where the figures come from
    notes: tuple = field(default=())


# Published figures (dense, no sparsity), per device; links per direction. ``efficiency`` is the
# maximum achievable matmul FLOP/s over the peak, measured with bf16 inputs by Stas Bekman's
# mamf-finder (ml-engineering, "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM 267.9
# of 312 TF (0.859, CUDA 12.1), H100 SXM 792.1 of 989 (0.801, CUDA 12.1); the H200 has the H100's
# compute. It is a best shape's ceiling: a model's own shapes reach it or less. fp32 products
# are given the same share of the fp32 peak, unmeasured.
PROFILES = {
    "h100": Profile(
        "h100", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 3.35e12, 450e9, 3e-6, 50e9, 10e-6, 8,
        memory=80 * 2 ** 30, fused=True, efficiency=0.801,
        source="NVIDIA H100 SXM datasheet (FP32 67 TF, BF16 989 TF dense, HBM3 3.35 TB/s, NVLink 900 GB/s both "
               "ways); one 400 Gb/s InfiniBand NIC per GPU"),
    "h200": Profile(
        "h200", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 4.8e12, 450e9, 3e-6, 50e9, 10e-6, 8,
        memory=141e9, fused=True, efficiency=0.801,
        source="NVIDIA H200 SXM datasheet (H100's compute, HBM3e 4.8 TB/s); one 400 Gb/s InfiniBand NIC per GPU"),
    "a100": Profile(
        "a100", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, 2.04e12, 300e9, 3e-6, 25e9, 10e-6, 8,
        memory=80 * 2 ** 30, fused=True, efficiency=0.859,
        source="NVIDIA A100 SXM 80GB datasheet (FP32 19.5 TF, BF16 312 TF, HBM2e 2.04 TB/s, NVLink 600 GB/s both "
               "ways); one 200 Gb/s HDR InfiniBand NIC per GPU (the DGX A100 of Megatron-LM's runs)"),
    # This machine (2 cores), measured by ``python benchmarks/cpu_profile.py`` (two runs, rounded): its
    # 8 fake JAX devices share the cores (the rates are all 8 at once), and a collective among them
    # is a memory copy after a rendezvous.
    "cpu": Profile(
        "cpu", {"float32": 130e9, "bfloat16": 130e9, "float16": 130e9}, 13e9, 2.0e9, 165e-6, 2.0e9, 165e-6, 64,
        memory=24 * 2 ** 30 / 8,
        efficiency=1.0, shared=True, per_collective=True,
        source="python benchmarks/cpu_profile.py on this 2-core machine, 8 fake devices at once: 256^3 fp32 "
               "products 123-141 GFLOP/s, an elementwise pass 12-14 GB/s, a collective 149-181 us plus the bytes "
               "one device sends at 1.8-2.1 GB/s"),
}


def crosses_nodes(mesh: Mesh, axes, node_devices: int) -> bool:
    """Whether rank 0's group over ``axes`` spans more than one node (sub-axes ``a.i`` count as
    their whole axis ``a``)."""
    names = {a.partition(".")[0] for a in axes}
    stride, last = 1, 0
    for name, size in reversed(mesh.axes):
        if name in names:
            last += (size - 1) * stride
        stride *= size
    return last >= node_devices


def _group(mesh: Mesh, axes) -> int:
    names = list(dict.fromkeys(a.partition(".")[0] for a in axes))
    return math.prod(mesh.axis_size(a) for a in names) if names else 2


_STEPS = {Kind.ALL_GATHER: lambda n: n - 1, Kind.REDUCE_SCATTER: lambda n: n - 1, Kind.ALL_TO_ALL: lambda n: n - 1,
          Kind.ALL_REDUCE: lambda n: 2 * (n - 1), Kind.PERMUTE: lambda n: 1}


def _collective(mesh: Mesh, kind: Kind, axes, nbytes: int, count: int, profile: Profile) -> tuple[float, bool]:
    """Seconds of ``count`` collectives sending ``nbytes`` in all, and whether they cross nodes."""
    out = crosses_nodes(mesh, axes, profile.node_devices)
    bw, lat = (profile.inter_bw, profile.inter_latency) if out else (profile.intra_bw, profile.intra_latency)
    steps = 1 if profile.per_collective else _STEPS[kind](_group(mesh, axes))
    return count * steps * lat + nbytes / bw, out


def comm_time(mesh: Mesh, records, profile: Profile) -> tuple[float, float]:
    """Seconds of ``records`` (kind, axes, nbytes) inside nodes and across them, none overlapped;
    gradient sums (records with ``param`` set, in the backward) joined in buckets of
    ``profile.bucket_bytes`` per (kind, axes), as DDP and parlay's torch backend join them."""
    intra = inter = 0.0
    buckets: dict = {}  # (kind, axes) -> bytes of the parameters' gradient sums
    for r in records:
        if getattr(r, "param", "") and r.backward:
            buckets[r.kind, r.axes] = buckets.get((r.kind, r.axes), 0) + r.nbytes
            continue
        t, out = _collective(mesh, r.kind, r.axes, r.nbytes, 1, profile)
        intra, inter = (intra, inter + t) if out else (intra + t, inter)
    for (kind, axes), nbytes in buckets.items():
        t, out = _collective(mesh, kind, axes, nbytes, max(1, math.ceil(nbytes / profile.bucket_bytes)), profile)
        intra, inter = (intra, inter + t) if out else (intra + t, inter)
    return intra, inter


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds: matrix products and the memory-bound rest
    comm: float  # seconds: every collective, none overlapped
    optimizer: float  # seconds: AdamW's pass over its shard
    intra: float  # of ``comm``: inside nodes
    inter: float  # of ``comm``: across nodes

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.optimizer

    def to_json(self) -> dict:
        return {"compute_s": self.compute, "comm_s": self.comm, "optimizer_s": self.optimizer,
                "comm_intra_node_s": self.intra, "comm_inter_node_s": self.inter, "total_s": self.total}


def step_time(mesh: Mesh, records, flops: int, written: "Written | int", optimizer_elems: int, profile: Profile,
              dtype: str = "float32") -> StepTime:
    """One step's seconds on ``profile``: rank 0's collectives (``records``: kind, axes, nbytes),
    its matrix-product ``flops``, the bytes its other ops write (``Written``, or one count), the
    elements of its AdamW shard."""
    written = written.on(profile) if isinstance(written, Written) else written
    devices = mesh.size if profile.shared else 1
    peak = profile.flops[dtype] * profile.efficiency
    compute = devices * (flops / peak + 2 * written / profile.memory_bw)
    intra, inter = comm_time(mesh, records, profile)
    optimizer = devices * optimizer_elems * 4 * 4 * 2 / profile.memory_bw  # p, g, m, v: read and written
    return StepTime(compute, intra + inter, optimizer, intra, inter)
