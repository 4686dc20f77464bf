"""Where a command's CPU goes, by kind of process: every process on this machine is read
from /proc twice a second while COMMAND runs (the test suite, a bench), and its user and
system time is added to a category named from its command line (training ranks, `gpuflow`
commands, Prefect servers, moto, the test clusters' daemons...). Processes that start and
end between two reads are missed; their share shows in no row.

    python bench/suite_cpu.py [--every 0.5] [--top 25] -- bash scripts/test.sh
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

# (a piece of the command line, its category), first match wins
CATEGORIES = [
    ("exec(eval(sys.stdin", "pytest workers (flows run in-process)"),
    ("moto_server", "moto"),
    ("uvicorn", "Prefect servers (tests' harness)"),
    ("gpuflow.tasks.platform.server", "gpuflow's Prefect servers"),
    ("-m gpuflow ", "gpuflow commands"),
    ("bin/gpuflow ", "gpuflow commands"),
    ("torch.distributed.run", "torchrun"),  # its command names the ranks' module too
    ("training.entry", "training ranks"),
    ("training.launch", "training launchers"),
    ("blender", "Blender"),
    ("kube-apiserver", "Kubernetes control plane"),
    ("etcd", "Kubernetes control plane"),
    ("kube-controller-manager", "Kubernetes control plane"),
    ("kube-scheduler", "Kubernetes control plane"),
    ("kwok", "Kubernetes control plane"),
    ("mpi-operator", "Kubernetes control plane"),
    ("kubelet", "the real node"),
    ("containerd", "the real node"),
    ("slurm", "Slurm"),
    ("munged", "Slurm"),
    ("ec2.agent", "EC2 agents"),
    ("ec2-metadata-mock", "metadata mocks"),
    ("postgres", "PostgreSQL"),
    ("mpirun", "MPI"),
    ("prted", "MPI"),
    ("hpc.", "MPI"),
    ("chrom", "Chromium"),
    ("prefect", "other Prefect processes"),
    ("pip", "pip"),
    ("pytest ", "pytest"),  # after the rest: their arguments often name pytest's folders
    ("python", "other Python"),
]


def category(cmdline: str) -> str:
    for piece, name in CATEGORIES:
        if piece in cmdline:
            return name
    return cmdline.split(" ")[0].rsplit("/", 1)[-1][:30] or "kernel threads"


def cpu_ticks(pid: str) -> tuple[str, int] | None:
    """Return (start time, user + system ticks) of a process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19], int(fields[11]) + int(fields[12])


def command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to watch after --")
    hz = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[str, str], tuple[int, str]] = {}  # (pid, start) -> (ticks, category)
    spent: collections.Counter[str] = collections.Counter()

    def read_all(count: bool) -> None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            read = cpu_ticks(pid)
            if read is None:
                continue
            start, ticks = read
            before, name = seen.get((pid, start), (0, ""))
            if not name:
                name = category(command_line(pid))
            if count:
                spent[name] += ticks - before
            seen[pid, start] = (ticks, name)

    read_all(count=False)  # what ran before the command is not its
    started = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        read_all(count=True)
        time.sleep(args.every)
    wall = time.monotonic() - started
    total = sum(spent.values()) or 1
    print(f"{wall:.0f} s of wall time, {total / hz:.0f} CPU-s seen ({total / hz / wall:.2f} cores)")
    for name, ticks in spent.most_common(args.top):
        print(f"{ticks / hz:9.1f} CPU-s {ticks / total * 100:6.1f} %  {name}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
