"""Open MPI launch lines, built as argv lists: hostfile, mpirun options, which variables
reach every rank, and the layout checks that must pass before anything starts. Pure.

The shape follows what works on GPU clusters:
`mpirun -np 4 -H server1:2,server2:2 --bind-to none --map-by slot -x NCCL_DEBUG ... prog`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

# Variables every rank needs when they are set here: NCCL and CUDA tuning, library paths.
EXPORT_PATTERNS = (
    re.compile(r"^NCCL_"),
    re.compile(r"^UCX_"),
    re.compile(r"^OMP_NUM_THREADS$"),
    re.compile(r"^LD_LIBRARY_PATH$"),
    re.compile(r"^PATH$"),
    re.compile(r"^PYTHONPATH$"),
    re.compile(r"^GPUFLOW_"),
)


class Host(BaseModel):
    """One machine ranks run on: its name as mpirun reaches it, slots, GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Host name as mpirun reaches it (ssh).")
    slots: int = Field(ge=1, le=4096, description="Ranks it takes without oversubscribing.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs it has for the ranks.")


class LayoutError(ValueError):
    """A rank layout that cannot run; the message names the field and the fix."""


def hostfile(hosts: list[Host]) -> str:
    """Return an Open MPI hostfile: one `name slots=N` line per host."""
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)


def renamed(hosts: list[Host], hostfile_text: str) -> list[Host]:
    """Return `hosts` under the names a hostfile gives, in order (node i is line i); its
    slots must match, or the ranks would not be placed as planned."""
    lines = [line.split() for line in hostfile_text.splitlines() if line.strip()]
    if len(lines) != len(hosts):
        raise LayoutError(f"the hostfile names {len(lines)} host(s), the job has {len(hosts)}")
    renamed = []
    for host, (name, *rest) in zip(hosts, lines, strict=True):
        slots = next((int(w.split("=")[1]) for w in rest if w.startswith("slots=")), host.slots)
        if slots != host.slots:
            raise LayoutError(f"the hostfile gives {name} {slots} slot(s), the job {host.slots}")
        renamed.append(host.model_copy(update={"name": name}))
    return renamed


def check_layout(
    ranks: int, hosts: list[Host], gpus_per_rank: int, oversubscribe: bool = False
) -> None:
    """Raise LayoutError unless `ranks` ranks fit on `hosts` as asked."""
    if ranks < 1:
        raise LayoutError("job.ranks must be at least 1; set the number of MPI processes")
    if not hosts:
        raise LayoutError(
            "job.hosts is empty; give at least one host, or leave it out to use this one"
        )
    slots = sum(h.slots for h in hosts)
    if ranks > slots and not oversubscribe:
        raise LayoutError(
            f"job.ranks: {ranks} ranks do not fit in {slots} slot(s); lower job.ranks, add"
            " slots or hosts, or set job.oversubscribe: true to run more ranks than slots"
        )
    if gpus_per_rank:
        for host, placed in zip(hosts, place(ranks, hosts), strict=True):
            if placed * gpus_per_rank > host.gpus:
                raise LayoutError(
                    f"job.gpus_per_rank: {placed} rank(s) x {gpus_per_rank} GPU(s) on {host.name}"
                    f" need {placed * gpus_per_rank} GPUs but it has {host.gpus}; lower"
                    " job.gpus_per_rank or job.ranks, or give the job more GPUs"
                )


def place(ranks: int, hosts: list[Host]) -> list[int]:
    """Return how many ranks `--map-by slot` puts on each host: fill each host's slots in
    order; ranks beyond every slot (oversubscribed) are counted one per host in turn, an
    assumption the GPU check only needs to be conservative about, not exact."""
    placed = [0] * len(hosts)
    left = ranks
    for i, host in enumerate(hosts):
        take = min(host.slots, left)
        placed[i] += take
        left -= take
    i = 0
    while left > 0:
        placed[i % len(hosts)] += 1
        left -= 1
        i += 1
    return placed


def exported(env: Mapping[str, str], extra: Iterable[str] = ()) -> list[str]:
    """Return the names of the variables to pass with -x: those matching EXPORT_PATTERNS
    that are set, plus `extra`; sorted, no duplicates. Values never enter the argv."""
    names = {n for n in env if any(p.match(n) for p in EXPORT_PATTERNS)}
    return sorted(names | set(extra))


def mpirun_argv(
    program: list[str],
    ranks: int,
    hosts: list[Host] | None,
    env_names: list[str],
    as_root: bool,
    oversubscribe: bool = False,
    mpirun: str = "mpirun",
    hostfile_path: str | None = None,
) -> list[str]:
    """Return the mpirun argv: ranks, hosts (a hostfile when given, else -H), no binding,
    slot mapping, -x per variable name; --allow-run-as-root only when running as root,
    --oversubscribe only when asked."""
    argv = [mpirun, "-np", str(ranks)]
    if hostfile_path:
        argv += ["--hostfile", hostfile_path]
    elif hosts:
        argv += ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
    argv += ["--bind-to", "none", "--map-by", "slot"]
    if as_root:
        argv.append("--allow-run-as-root")
    if oversubscribe:
        argv.append("--oversubscribe")
    for name in env_names:
        argv += ["-x", name]
    return [*argv, *program]
