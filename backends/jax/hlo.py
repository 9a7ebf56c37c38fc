"""The collectives in XLA's compiled HLO, costed with parlay's cost model.

``parse_collectives(hlo_text, num_devices)`` lists every all-gather, all-reduce, reduce-scatter,
all-to-all and collective-permute (async ``-start`` forms included) with its group size, operand
sizes and the bytes each device sends (``parlay.core.collective_bytes``, ring algorithms), so
XLA's choices and parlay's plans compare like for like.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

from ...core import Kind, collective_bytes

__all__ = ["Collective", "parse_collectives", "busiest_device_bytes", "count_collectives"]


_KINDS = {
    "all-gather": Kind.ALL_GATHER,
    "all-reduce": Kind.ALL_REDUCE,
    "reduce-scatter": Kind.REDUCE_SCATTER,
    "all-to-all": Kind.ALL_TO_ALL,
    "collective-permute": Kind.PERMUTE,
}
# Collective opcodes this benchmark cannot cost: seeing one is an error, not a silent zero.
_UNSUPPORTED = ("ragged-all-to-all", "collective-broadcast")

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}


@dataclass(frozen=True)
class _Leaf:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elems(self) -> int:
        return math.prod(self.dims)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]


def _parse_shape(text: str, i: int = 0):
    """Parse an HLO shape at ``text[i:]``: a ``_Leaf`` or a list (tuple). Returns (shape, end)."""
    while text[i] == " ":
        i += 1
    if text[i] == "(":
        items, i = [], i + 1
        while True:
            while text[i] in " ,":
                i += 1
            if text.startswith("/*", i):  # /*index=5*/
                i = text.index("*/", i) + 2
                continue
            if text[i] == ")":
                return items, i + 1
            item, i = _parse_shape(text, i)
            items.append(item)
    m = re.compile(r"(\w+)\[([^\]]*)\]").match(text, i)
    if not m:
        raise ValueError(f"cannot parse an HLO shape at {text[i:i + 60]!r}")
    dims = tuple(int(re.sub(r"[^\d]", "", d)) for d in m.group(2).split(",") if d.strip())
    i = m.end()
    if i < len(text) and text[i] == "{":  # layout, e.g. {1,0} or {1,0:T(8,128)}
        depth = 0
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
    return _Leaf(m.group(1), dims), i


def _leaves(shape) -> list[_Leaf]:
    return [shape] if isinstance(shape, _Leaf) else [x for s in shape for x in _leaves(s)]


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?P<how>body|condition|calls|to_apply|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPCODE = re.compile(r"\s*(?P<op>[a-z][\w\-]*)\(")


def _split_args(text: str, i: int) -> tuple[list[str], int]:
    """The top-level comma-separated operands of ``op(...)`` starting at ``text[i] == '('``."""
    depth, start, args = 0, i + 1, []
    for j in range(i, len(text)):
        c = text[j]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                a = text[start:j].strip()
                if a:
                    args.append(a)
                return args, j + 1
        elif c == "," and depth == 1:
            args.append(text[start:j].strip())
            start = j + 1
    raise ValueError(f"unbalanced operands in {text[i:i + 80]!r}")


def _group_size(attrs: str, num_devices: int) -> tuple[int, tuple[tuple[int, ...], ...] | None]:
    """Group size from ``replica_groups``; also the explicit groups when they are listed."""
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return num_devices, None
    rest = attrs[m.end():]
    if rest.startswith("mesh["):  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'} (or 'axis_0':(1)2)
        mm = re.match(r"mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
        if not mm:
            raise ValueError(f"cannot parse replica_groups {rest[:80]!r}")
        sizes = {k: int(v) for k, v in re.findall(r"'?([\w.]+)'?\s*=\s*(\d+)", mm.group(1))}
        n = 1
        for ax in (a.strip() for a in mm.group(2).split(",") if a.strip()):
            sub = re.match(r"'?([\w.]+)'?\s*:\s*\((\d+)\)\s*(\d+)$", ax)
            n *= int(sub.group(3)) if sub else sizes[ax.strip("'")]
        return n, None
    if rest.startswith("["):  # iota: [groups,size]<=[8] or [4,2]<=[2,2,2]T(0,2,1)
        mm = re.match(r"\[([\d,]+)\]<=", rest)
        if not mm:
            raise ValueError(f"cannot parse replica_groups {rest[:80]!r}")
        return int(mm.group(1).split(",")[-1]), None
    if rest.startswith("{"):  # explicit {{0,1},{2,3}} or {} (all devices in one group)
        _, end = _split_args(rest.replace("{", "(").replace("}", ")"), 0)
        body = rest[1:end - 1].strip()
        if not body:
            return num_devices, None
        groups = tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([^{}]*)\}", body))
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"replica groups of different sizes: {groups}")
        return sizes.pop(), groups
    raise ValueError(f"cannot parse replica_groups {rest[:80]!r}")


@dataclass
class Collective:
    """One collective instruction of the optimized HLO, costed with parlay's model."""

    name: str
    opcode: str  # as printed, e.g. all-gather-start
    kind: Kind
    group_size: int  # for permutes: how many (source, target) pairs move data
    operand_elems: tuple[int, ...]  # per operand, inferred from the result shape
    operand_elems_by_name: tuple[int, ...] | None  # per operand, from the operands' own shapes
    itemsize: int
    per_device: dict[int, int] = field(default_factory=dict)  # bytes each device sends
    trips: int = 1  # how many times it runs in one call of the program (a loop's body: its known trip count)

    @property
    def bytes(self) -> int:
        """What the busiest device sends in this instruction."""
        return max(self.per_device.values(), default=0)

    def describe(self) -> str:
        if self.kind is Kind.PERMUTE:
            return f"{self.opcode}({self.group_size} pairs)"
        return f"{self.opcode}(n={self.group_size})"


def _operand_elems(kind: Kind, opcode: str, result, n: int, attrs: str) -> tuple[list[int], int]:
    """Infer each operand's element count from the result shape; also the item size."""
    start = opcode.endswith("-start")
    if kind is Kind.ALL_GATHER:
        # all-gather-start returns (operand(s), result(s)); the result is n x the operand.
        res = result[1] if start else result
        leaves = _leaves(res)
        dm = re.search(r"dimensions=\{(\d+)\}", attrs)
        if dm:
            d = int(dm.group(1))
            for leaf in leaves:
                if leaf.dims[d] % n:
                    raise ValueError(f"all-gather result {leaf} not divisible by {n} along dim {d}")
        return [leaf.elems // n for leaf in leaves], leaves[0].itemsize
    if kind is Kind.REDUCE_SCATTER:
        leaves = _leaves(result[1] if start else result)
        return [leaf.elems * n for leaf in leaves], leaves[0].itemsize
    if kind is Kind.PERMUTE and start:
        # collective-permute-start returns (operand(s), result(s), context scalars...)
        leaves = _leaves(result[0])
        return [leaf.elems for leaf in leaves], leaves[0].itemsize
    if start and kind is Kind.ALL_TO_ALL:
        leaves = _leaves(result[1])
        return [leaf.elems for leaf in leaves], leaves[0].itemsize
    leaves = _leaves(result)  # all-reduce(-start), all-to-all, collective-permute: same size
    return [leaf.elems for leaf in leaves], leaves[0].itemsize


def parse_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """Every collective instruction in ``hlo`` (``-done`` halves skipped), costed per device."""
    shapes: dict[str, object] = {}
    found = []
    calls: list[tuple[str, str, int]] = []  # (caller, callee, times per call of the caller)
    where, entry = "", ""
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            where = head.group("name")
            entry = where if head.group("entry") else entry
            continue
        for c in _CALLED.finditer(line):  # a while's body runs its known trip count times
            trips = _TRIPS.search(line) if c.group("how") == "body" else None
            calls.append((where, c.group("name"), int(trips.group(1)) if trips else 1))
        for b in _BRANCHES.finditer(line):  # a conditional's branches: each counted as if it ran (a bound)
            calls += [(where, n.strip().lstrip("%"), 1) for n in b.group("names").split(",") if n.strip()]
        m = _INSTR.match(line)
        if not m:
            continue
        try:
            shape, i = _parse_shape(line, m.end())
        except (ValueError, IndexError):
            continue  # not an instruction line (e.g. a computation header)
        name = m.group("name")
        shapes[name] = shape
        om = _OPCODE.match(line, i)
        if not om:
            continue
        op = om.group("op")
        if op in _UNSUPPORTED:
            raise ValueError(f"the benchmark cannot cost {op}: {line.strip()[:200]}")
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base not in _KINDS:
            continue
        args, end = _split_args(line, om.end() - 1)
        found.append((name, op, _KINDS[base], shape, args, line[end:], where))

    runs = _runs(entry, calls)
    out = []
    for name, op, kind, shape, args, attrs, where in found:
        by_name = None
        arg_names = [re.sub(r"/\*.*?\*/", "", a).split()[-1].lstrip("%") for a in args]
        if all(a in shapes for a in arg_names):
            by_name = tuple(leaf.elems for a in arg_names for leaf in _leaves(shapes[a]))
        per_device: dict[int, int] = {}
        if kind is Kind.PERMUTE:
            pm = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs) or re.search(r"source_target_pairs=\{\}", attrs)
            pairs = [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)", pm.group(0))] if pm else []
            elems, itemsize = _operand_elems(kind, op, shape, 1, attrs)
            moving = [(s, t) for s, t in pairs if s != t]
            for s, _ in moving:  # each moving pair sends the operand(s) once from its source
                per_device[s] = per_device.get(s, 0) + sum(collective_bytes(kind, 2, e, itemsize) for e in elems)
            n = len(moving)
        else:
            n, groups = _group_size(attrs, num_devices)
            elems, itemsize = _operand_elems(kind, op, shape, n, attrs)
            if kind is Kind.ALL_TO_ALL and len(elems) > 1:
                # tuple all-to-all: operand k is the piece for group member k; one buffer in all
                sent = collective_bytes(kind, n, sum(elems), itemsize)
            else:
                sent = sum(collective_bytes(kind, n, e, itemsize) for e in elems)
            members = sorted({d for g in groups for d in g}) if groups else range(num_devices)
            per_device = {d: sent for d in members} if n > 1 else {}
        out.append(Collective(name, op, kind, n, tuple(elems), by_name, itemsize, per_device, runs.get(where, 1)))
    return out


def _runs(entry: str, calls: list[tuple[str, str, int]]) -> dict[str, int]:
    """How many times each computation runs in one call of ``entry``: a while's body its known
    trip count times per run of its caller (1 where XLA does not know the count), any other callee
    once per run of each caller, summed over its callers."""
    runs = {entry: 1}
    for _ in range(len(calls) + 1):  # callees may be printed before their callers: to a fixed point
        new = {entry: 1}
        for caller, callee, times in calls:
            if caller in runs and callee != entry:
                new[callee] = new.get(callee, 0) + runs[caller] * times
        if new == runs:
            break
        runs = new
    return runs


def busiest_device_bytes(colls: Iterable[Collective]) -> int:
    """Sum each device's bytes over the program's collectives; the largest sum."""
    totals: dict[int, int] = {}
    for c in colls:
        for d, b in c.per_device.items():
            totals[d] = totals.get(d, 0) + b
    return max(totals.values(), default=0)



def count_collectives(colls: Iterable[Collective]) -> dict[str, int]:
    """{"all-gather(n=4)": count, ...} in program order of first appearance."""
    out: dict[str, int] = {}
    for c in colls:
        key = f"{c.kind.value}(n={c.group_size})"
        out[key] = out.get(key, 0) + 1
    return out
