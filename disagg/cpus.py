"""Which cores a server's DP workers run on: Linux CPU lists (`0-3,8,10-11`), a server's CPUs split
among its DP ranks, and `disagg serve`'s split of the machine between prefill and decode.

Pure but for `usable_cpus()`: the functions take the CPUs this process may use; the worker applies
its set itself (disagg/worker/process.py). Where the OS cannot pin (not Linux) nothing is pinned by default
and a CPU list is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from disagg.config import ConfigError

CpuSet = frozenset[int]


def usable_cpus() -> CpuSet | None:
    """The CPUs this process may run on (`os.sched_getaffinity(0)`); None where the OS cannot pin."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def parse_cpu_list(text: str, name: str = "--cpus") -> CpuSet:
    """`0-3,8` -> {0, 1, 2, 3, 8}; ConfigError naming the option `name` for anything else."""
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ConfigError(f"{name} {text!r}: {item!r} is not a CPU number or a range such as 0-3 "
                              "(write a Linux CPU list, e.g. 0-3,8,10-11)")
        first, last = int(low), int(high if dash else low)
        if last < first:
            raise ConfigError(f"{name} {text!r}: the range {item!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> `0-3,8`: the shortest Linux CPU list."""
    items: list[str] = []
    ordered = sorted(cpus)
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            first = ordered[start]
            items.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(items)


def check_usable(cpus: CpuSet, usable: CpuSet | None, name: str = "--cpus") -> CpuSet:
    """`cpus` when this process may run on every one of them (`usable`), else ConfigError."""
    if usable is None:
        raise ConfigError(f"{name} needs an OS that pins processes to CPUs (Linux's sched_setaffinity)")
    missing = cpus - usable
    if missing:
        raise ConfigError(f"{name} {format_cpu_list(cpus)}: CPU {format_cpu_list(missing)} is not usable by this "
                          f"process (it may use {format_cpu_list(usable)})")
    return cpus


def split_cpus(cpus: CpuSet, num_parts: int) -> tuple[CpuSet, ...]:
    """`cpus` in `num_parts` contiguous runs of the sorted list, as even as possible, the earlier parts
    one CPU larger. With fewer CPUs than parts, parts share: part r gets CPU number r mod len(cpus)
    of the sorted list, one CPU each."""
    assert cpus and num_parts >= 1, f"cannot split {sorted(cpus)} into {num_parts} parts"
    ordered = sorted(cpus)
    if len(ordered) < num_parts:
        return tuple(frozenset({ordered[r % len(ordered)]}) for r in range(num_parts))
    size, extra = divmod(len(ordered), num_parts)
    parts, start = [], 0
    for r in range(num_parts):
        end = start + size + (r < extra)
        parts.append(frozenset(ordered[start:end]))
        start = end
    return tuple(parts)


def worker_cpu_sets(cpus: str | None, dp_size: int, usable: CpuSet | None) -> tuple[CpuSet, ...] | None:
    """Each DP rank's CPUs under a server's `--cpus` (None: not pinned)."""
    if cpus is None:
        return None
    return split_cpus(check_usable(parse_cpu_list(cpus), usable), dp_size)


def plan_cluster_cpus(usable: CpuSet | None, prefill: str | None = None,
                      decode: str | None = None) -> tuple[CpuSet | None, CpuSet | None]:
    """(prefill's CPUs, decode's CPUs) of `disagg serve`. By default the usable CPUs in two halves,
    prefill the first (one more when odd); one CPU is shared by both; (None, None) where the OS cannot
    pin. A list given for one role leaves the other the usable CPUs it does not name."""
    if usable is None and prefill is None and decode is None:
        return None, None
    given = {role: None if text is None else check_usable(parse_cpu_list(text, f"--{role}-cpus"), usable,
                                                         f"--{role}-cpus")
             for role, text in (("prefill", prefill), ("decode", decode))}
    if given["prefill"] is None and given["decode"] is None:
        first, second = split_cpus(usable, 2)
        return first, second
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if given[role] is None:
            rest = usable - given[other]
            if not rest:
                raise ConfigError(f"--{other}-cpus {format_cpu_list(given[other])} leaves no CPU for {role}: "
                                  f"give --{role}-cpus too (the lists may overlap)")
            given[role] = rest
    return given["prefill"], given["decode"]
