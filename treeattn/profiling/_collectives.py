"""Count the collectives of a compiled XLA program and the bytes each device sends.

`jax.stages.Compiled.cost_analysis()` says nothing about communication, so this reads the
optimised HLO text: every all-reduce, collective-permute, all-gather, reduce-scatter and
all-to-all, with its buffer size and replica-group size, multiplied by the trip count of the
`while` loops around it.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any


_KINDS = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_COMP = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_SHAPE = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:e\dm\d(?:fn)?)?)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program."""

    kind: str  # all-reduce, collective-permute, all-gather, reduce-scatter, all-to-all
    name: str
    buffer_bytes: int  # bytes of the (per-device) operand
    group_size: int  # devices taking part in each group
    executions: int  # times it runs: the product of enclosing while-loop trip counts
    source_target_pairs: int = 0  # collective-permute only

    @property
    def bytes_sent(self) -> float:
        """Bytes one device sends per execution, with ring algorithms for the reductions:
        all-reduce 2(g-1)/g of the buffer (reduce-scatter + all-gather), all-gather,
        reduce-scatter and all-to-all (g-1)/g, collective-permute the whole buffer."""
        g = self.group_size
        if self.kind == "collective-permute":
            return float(self.buffer_bytes)
        if g <= 1:
            return 0.0
        factor = 2.0 * (g - 1) / g if self.kind == "all-reduce" else (g - 1) / g
        return factor * self.buffer_bytes


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """All collectives of a compiled program."""

    collectives: tuple[Collective, ...]
    unknown_trip_counts: int  # while loops whose trip count XLA did not record (counted once)

    def count(self, kind: str | None = None) -> int:
        """Executions of collectives of `kind` (all kinds when None)."""
        return sum(c.executions for c in self.collectives if kind in (None, c.kind))

    def bytes_sent(self, kind: str | None = None) -> float:
        """Bytes one device sends over the whole program (ring model, see `Collective`)."""
        return sum(c.bytes_sent * c.executions for c in self.collectives if kind in (None, c.kind))

    def max_buffer_bytes(self, kind: str | None = None) -> int:
        return max((c.buffer_bytes for c in self.collectives if kind in (None, c.kind)), default=0)

    def summary(self) -> dict[str, Any]:
        return {
            kind: {"count": self.count(kind), "bytes_sent": self.bytes_sent(kind)}
            for kind in _KINDS
            if self.count(kind)
        }


def _array_bytes(type_text: str, first_only: bool) -> int:
    total = 0
    for m in _SHAPE.finditer(type_text):
        dtype = m.group("dtype")
        if dtype not in _BYTES:
            continue
        n = 1
        for d in filter(None, m.group("dims").split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
        if first_only:
            break
    return total


def _group_size(rest: str, num_devices: int | None) -> int:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if m:
        first = re.match(r"\{([\d,]*)\}", m.group(1))
        ids = [x for x in first.group(1).split(",") if x] if first else []
        return max(len(ids), 1)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)  # iota form [groups, size]
    if m:
        return int(m.group(2))
    return num_devices or 1


def collective_stats(compiled: Any, *, num_devices: int | None = None) -> CollectiveStats:
    """Collectives of a compiled program (`jax.jit(f).lower(...).compile()`) or its HLO text.

    Instructions inside `while` bodies are counted once per iteration (XLA's
    `known_trip_count`); `num_devices` is the group size assumed where an instruction lists no
    replica groups.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comp_of: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    edges: list[tuple[str, str, int | None]] = []
    entry, current = None, None
    for line in text.splitlines():
        cm = _COMP.match(line)
        if cm:
            current = cm.group("name")
            if cm.group("entry"):
                entry = current
            continue
        if current is None:
            continue
        im = _INSTR.match(line)
        if not im:
            continue
        op, rest = im.group("op"), im.group("rest")
        comp_of[current].append((im.group("name"), im.group("type"), op, rest))
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", rest)
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
            if body:
                edges.append((current, body.group(1), int(trip.group(1)) if trip else None))
        elif op in ("call", "async-start"):
            for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", rest):
                edges.append((current, callee, 1))
        elif op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            for callee in re.findall(r"%?([\w.\-]+)", branches.group(1) if branches else ""):
                edges.append((current, callee, 1))
    # Executions of each computation reached from the entry.
    runs: dict[str, int] = defaultdict(int)
    unknown = 0
    if entry is not None:
        runs[entry] = 1
        frontier = [entry]
        while frontier:
            comp = frontier.pop()
            for parent, child, trip in edges:
                if parent != comp:
                    continue
                if trip is None:
                    unknown += 1
                runs[child] += runs[comp] * (trip or 1)
                frontier.append(child)
    found = []
    for comp, instructions in comp_of.items():
        if not runs.get(comp):
            continue
        for name, type_text, op, rest in instructions:
            kind = op.removesuffix("-start")
            if kind not in _KINDS or op.endswith("-done"):
                continue
            permute = kind == "collective-permute"
            pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
            found.append(
                Collective(
                    kind=kind,
                    name=name,
                    buffer_bytes=_array_bytes(type_text, first_only=op.endswith("-start")),
                    group_size=2 if permute else _group_size(rest, num_devices),
                    executions=runs[comp],
                    source_target_pairs=pairs.group(1).count("{") if pairs else 0,
                )
            )
    return CollectiveStats(collectives=tuple(found), unknown_trip_counts=unknown)
