"""Why a unit failed, and what to change: one table of the failures gpuflow knows (GPU
memory, collectives, drivers, the machine, Python, Blender, MPI), read from a unit's log
lines, exit code and signal. Pure: no Prefect, no I/O.

Each row is a cause and its fix in one or two sentences; the first row whose pattern
matches a line wins (rows are ordered most specific first). Rows of a program (Blender)
apply to that program's errors only. Exit codes and signals speak when no line does.
"""

from __future__ import annotations

import re
import signal as signals
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cause:
    kind: str
    pattern: re.Pattern[str]
    advice: str  # {0}, {1}: the pattern's groups; {context}: what the run knows (peak, batch)
    program: str = "any"  # "blender": Blender's own errors only
    transient: bool = False  # another try may succeed as it is


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    message: str
    transient: bool = False


def _c(kind: str, pattern: str, advice: str, program: str = "any", **kw: Any) -> Cause:
    return Cause(kind, re.compile(pattern), advice, program, **kw)


CAUSES: list[Cause] = [
    # -- PyTorch, CUDA, NCCL, gloo ---------------------------------------------------------
    _c(
        "cuda_out_of_memory",
        r"CUDA out of memory\. Tried to allocate ([\d.]+ [KMGT]i?B)",
        "the GPU ran out of memory (it tried to allocate {0} more{context}); lower"
        " job.batch_size, keep job.amp: auto, turn on job.activation_checkpointing, or ask"
        " for a GPU with more memory (resources.gpu_product).",
    ),
    _c(
        "cuda_out_of_memory",
        r"OutOfMemoryError: CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED",
        "the GPU ran out of memory{context}; lower job.batch_size, keep job.amp: auto, turn"
        " on job.activation_checkpointing, or ask for a GPU with more memory.",
    ),
    _c(
        "collective_timeout",
        r"Watchdog caught collective operation timeout: .*?OpType=(\w+)",
        "a collective ({0}) timed out: a rank stalled or died before it; read the other"
        " ranks' first error (uneven data per rank and a crashed rank are the usual causes)"
        " and rerun.",
        transient=True,
    ),
    _c(
        "collective_timeout",
        r"(?i)gloo.*timed out|timed out waiting \d+ms for (?:recv|send) operation",
        "a gloo collective timed out: a rank stalled or died before it; read the other"
        " ranks' first error and rerun.",
        transient=True,
    ),
    _c(
        "nccl_system_error",
        r"NCCL error.*unhandled system error",
        "NCCL hit a system error (shared memory or network between GPUs); give the job more"
        " /dev/shm (resources.shm), check that its nodes reach each other, and rerun with"
        " NCCL_DEBUG=INFO in env to see which.",
    ),
    _c(
        "driver_too_old",
        r"NVIDIA driver on your system is too old|CUDA driver version is insufficient",
        "the NVIDIA driver is older than the CUDA this torch was built for; install a torch"
        " build for the driver's CUDA (gpuflow preflight shows both) or update the driver.",
    ),
    _c(
        "no_kernel_image",
        r"no kernel image is available for execution on the device",
        "this torch has no kernels for this GPU's architecture; install a torch build that"
        " supports it (newer for new GPUs, or one built for its compute capability).",
    ),
    _c(
        "loader_worker_killed",
        r"DataLoader worker \(pid\(?s?\)? ?[\d, ]*\)? is killed by signal: (.+?)\.?\s*$",
        "a data loader worker was killed ({0}), most often for memory; lower job.num_workers"
        " or job.shuffle_buffer, or raise resources.memory and resources.shm.",
    ),
    _c(
        "loader_shm",
        r"insufficient shared memory \(shm\)",
        "data loader workers ran out of shared memory; raise resources.shm or lower"
        " job.num_workers.",
    ),
    # -- the machine and Python ----------------------------------------------------------
    _c(
        "no_space",
        r"No space left on device|\[Errno 28\]",
        "the disk filled up; raise resources.disk, keep fewer checkpoints"
        " (job.checkpoint.keep), or write outputs to S3.",
    ),
    _c(
        "missing_module",
        r"ModuleNotFoundError: No module named '([^']+)'",
        "Python module {0} is not installed where the job runs; add it to the job's image or"
        " environment (pip install {0}).",
    ),
    _c(
        "segfault",
        r"Segmentation fault",
        "the program crashed (segmentation fault): usually a native library (a CUDA, MPI or"
        " torch extension build) that does not match the rest; rebuild or pin it.",
    ),
    # -- MPI -----------------------------------------------------------------------------
    _c(
        "mpi_slots",
        r"There are not enough slots available",
        "MPI had fewer slots than ranks; lower job.ranks or give the job more nodes or CPUs.",
    ),
    _c(
        "mpi_launch",
        r"mpirun was unable to launch the specified application|could not access\s+or execute",
        "mpirun could not start the program; check job.program exists and is executable on"
        " every node (built by job.build, or in job.inputs).",
    ),
    _c(
        "mpi_daemons",
        r"ORTE was unable to reliably start one or more daemons|PRTE has lost communication",
        "MPI could not start its daemons on every node; check that the nodes reach each other"
        " (ssh or the launcher's transport).",
        transient=True,
    ),
    # -- the program itself (last of the rows for any log: the more specific come first) ---
    _c(
        "program_not_found",
        # dash and bash say so after their $0 (sh, bash, a wrapper's name) and a line number
        r"(?:^|\s)[\w./-]+: (?:\d+: |line \d+: )?([^\s:]+): (?:command )?not found\s*$"
        r'|exec: "([^"]+)": executable file not found',
        "the program {0} is not where the job runs (not in its image, or not on its PATH);"
        " install it there or give job.command its full path.",
    ),
    # -- Blender (its own errors) ----------------------------------------------------------
    _c(
        "missing_file",
        r"Cannot read file '(.+?)': No such file",
        "the scene {0} does not exist; check the path or URL",
        "blender",
    ),
    _c(
        "not_a_blend",
        r"File format is not supported in file '(.+?)'",
        "{0} is not a .blend file; upload the scene itself",
        "blender",
    ),
    _c(
        "corrupt_blend",
        r"Failed to read blend file '(.+?)': (.+)",
        "{0} is damaged ({1}); upload it again, it may have been cut short",
        "blender",
    ),
    _c(
        "bad_frame_argument",
        r"not a number '-f / --render-frame (.+?)'",
        "Blender did not understand the frames {0}; this is a gpuflow bug, please report it",
        "blender",
    ),
    _c(
        "no_denoiser",
        r"Build without OpenImageDenoiser",
        "this Blender has no OpenImageDenoise but the scene denoises; set denoise: false or"
        " use a Blender build with it",
        "blender",
    ),
    _c(
        "device_absent",
        r"Found no Cycles device of the specified type",
        "Blender found no GPU of the requested Cycles device type here; run on a host with"
        " one, or set device: CPU",
        "blender",
    ),
    _c(
        "device_unknown",
        r"(\S+) is not a valid Cycles device",
        "{0} is not a Cycles device name; use CPU, CUDA, OPTIX, HIP, ONEAPI or METAL",
        "blender",
    ),
    _c(
        "no_camera",
        r"(?i)no camera",
        "the scene has no active camera; set one in the .blend",
        "blender",
    ),
    _c(
        "out_of_memory",
        r"(?i)out of memory",
        "the render ran out of memory; lower the resolution or samples, or use a GPU with more"
        " memory",
        "blender",
    ),
]


def causes_for(program: str) -> list[Cause]:
    """Return the rows that apply to `program`'s lines ("any": every unit's log)."""
    return [c for c in CAUSES if c.program == program]


def match(lines: Iterable[str], program: str = "any", context: str = "") -> Diagnosis | None:
    """Return the first known cause a line shows (rows in table order, lines from the
    last: the error nearest the end is the one that ended the job), else None."""
    rows = causes_for(program)
    text = list(lines)
    for cause in rows:
        for line in reversed(text):
            if found := cause.pattern.search(line):
                groups = [g for g in found.groups() if g is not None]  # alternatives' groups
                advice = cause.advice.format(*groups, context=context)
                return Diagnosis(cause.kind, advice, cause.transient)
    return None


def diagnose(
    exit_code: int | None,
    signal: int | None,
    lines: Iterable[str],
    context: Mapping[str, Any] | None = None,
) -> Diagnosis | None:
    """Return why a unit failed and what to change, from its log lines first, then its
    exit code or signal; None when nothing known explains it (or it did not fail).

    `context` may hold `peak_gpu_memory_mib`, `batch_size` and `memory_events` (the
    cgroup's memory.events: an `oom_kill` count) to make the advice precise."""
    context = context or {}
    if exit_code in (0, None) and signal is None:
        return None
    found = match(lines, "any", _context(context))
    if found is not None:
        return found
    number = signal if signal is not None else _signal_of(exit_code)
    if number == signals.SIGKILL:
        kills = int((context.get("memory_events") or {}).get("oom_kill", 0))
        if kills:
            return Diagnosis(
                "oom_killed",
                f"the kernel's out-of-memory killer stopped the job ({kills} kill(s) in its"
                " memory cgroup); raise resources.memory, or lower job.batch_size or"
                " job.num_workers.",
            )
        return Diagnosis(
            "killed",
            "the job was killed by SIGKILL, most often the out-of-memory killer; raise"
            " resources.memory or lower job.batch_size and job.num_workers, then rerun.",
        )
    if number == signals.SIGSEGV:
        return Diagnosis(
            "segfault",
            "the program crashed (segmentation fault): usually a native library (a CUDA, MPI"
            " or torch extension build) that does not match the rest; rebuild or pin it.",
        )
    if exit_code == 127 and signal is None:  # a shell's "command not found"
        return Diagnosis(
            "program_not_found",
            "the job's program was not found where it runs (exit 127); install it there"
            " or give job.command its full path.",
        )
    if number == signals.SIGBUS:
        return Diagnosis(
            "bus_error",
            "the program hit a bus error, often /dev/shm full; raise resources.shm or lower"
            " job.num_workers.",
        )
    return None


def _signal_of(exit_code: int | None) -> int | None:
    """A shell reports a child killed by signal N as exit 128+N."""
    if exit_code is not None and 128 < exit_code < 128 + 65:
        return exit_code - 128
    return None


def _context(context: Mapping[str, Any]) -> str:
    parts = []
    if context.get("peak_gpu_memory_mib"):
        parts.append(f"peak {float(context['peak_gpu_memory_mib']) / 1024:.1f} GiB seen")
    if context.get("batch_size"):
        parts.append(f"batch size {context['batch_size']}")
    return f"; {', '.join(parts)}" if parts else ""
