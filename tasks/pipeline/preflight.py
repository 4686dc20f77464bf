"""Preflight: is this host able to run the job as asked? Driver, CUDA, torch, disk, NCCL.

`inspect` gathers facts (NVML, nvidia-smi, torch, disk); `verdict` turns facts into
pass/warn/fail findings, each with the fix in words. `verdict` is pure.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from gpuflow.tasks import compat, nvml
from gpuflow.tasks.host import resolve_program
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.units import format_bytes

Level = Literal["pass", "warn", "fail"]


class Check(BaseModel):
    name: str
    level: Level
    message: str


class TorchInfo(BaseModel):
    version: str | None = None
    cuda_build: str | None = None
    cuda_available: bool | None = None  # None: not asked (job does not use torch)
    device_count: int | None = None
    # the Python asked (the job's own, where it is not gpuflow's); None: gpuflow's
    python: str | None = None
    import_error: str | None = None  # why that Python could not import torch


class HostFacts(BaseModel):
    nvml: nvml.NvmlStatus
    nvidia_smi: str | None
    torch: TorchInfo
    disk_free_bytes: int | None
    nccl_env: dict[str, str]
    cpu_count: int | None = None
    memory_total_bytes: int | None = None
    shm_total_bytes: int | None = None


class PreflightReport(BaseModel):
    verdict: Level
    checks: list[Check]
    facts: HostFacts
    gpus_reserved: list[int]

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.level == "fail"]


def job_torch_info(python: str, where: Callable[[list[str]], list[str]] = list) -> TorchInfo:
    """Return torch's version, CUDA build and devices as the job's own Python `python`
    sees them (in a child process: its packages, not gpuflow's), run `where` the job runs
    (in its image, with its GPUs)."""
    code = (
        "import json\ntry:\n import torch\nexcept Exception as e:\n"
        " print(json.dumps([None, f'{type(e).__name__}: {e}', None, False, 0]))\nelse:\n"
        " ok = torch.cuda.is_available()\n"
        " print(json.dumps([torch.__version__, None, torch.version.cuda, ok,"
        " torch.cuda.device_count() if ok else 0]))"
    )
    try:
        done = subprocess.run(
            where([python, "-c", code]), capture_output=True, text=True, timeout=120, check=True
        )
        version, error, cuda, available, count = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return TorchInfo(python=python, import_error=f"it could not be run ({exc})")
    return TorchInfo(
        version=version,
        cuda_build=cuda,
        cuda_available=available if version else None,
        device_count=count,
        python=python,
        import_error=error,
    )


def torch_info(probe_cuda: bool) -> TorchInfo:
    """Return torch's version and CUDA build; ask CUDA only when `probe_cuda` (importing
    torch costs a second or two, so jobs that do not use it skip that)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return TorchInfo()
    info = TorchInfo(version=version, cuda_build=compat.cuda_from_torch_version(version))
    if probe_cuda:
        # In a child process: a broken CUDA setup must not take the orchestrator down.
        code = (
            "import torch,json;print(json.dumps([torch.version.cuda,torch.cuda.is_available(),"
            "torch.cuda.device_count() if torch.cuda.is_available() else 0]))"
        )
        try:
            out = (
                subprocess.run(
                    [sys.executable, "-c", code],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            cuda, available, count = json.loads(out)
            info = info.model_copy(
                update={"cuda_build": cuda, "cuda_available": available, "device_count": count}
            )
        except (subprocess.SubprocessError, ValueError, IndexError):
            info = info.model_copy(update={"cuda_available": False, "device_count": 0})
    return info


def inspect(
    workspace: str | None,
    uses_torch: bool,
    visible_gpus: list[int] | None = None,
    nvml_module: types.ModuleType | None = None,
    python: str | None = None,
    where: Callable[[list[str]], list[str]] = list,
) -> HostFacts:
    """Return what this host offers: GPUs (NVML), nvidia-smi, torch (as `python`, the
    job's own Python, sees it `where` the job runs; gpuflow's without one), free disk,
    NCCL vars."""
    status = nvml.query(nvml_module)
    if uses_torch and python is not None:
        torch = job_torch_info(python, where)
    else:
        torch = torch_info(uses_torch and status.available and bool(status.gpus))
    disk = shutil.disk_usage(workspace).free if workspace and os.path.isdir(workspace) else None
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    import psutil

    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    return HostFacts(
        nvml=status,
        nvidia_smi=shutil.which("nvidia-smi"),
        torch=torch,
        disk_free_bytes=disk,
        nccl_env=nccl,
        cpu_count=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        memory_total_bytes=psutil.virtual_memory().total,
        shm_total_bytes=shm,
    )


def verdict(spec: JobSpec, facts: HostFacts, reserved: list[int]) -> PreflightReport:
    """Return pass/warn/fail findings for running `spec` with `reserved` GPUs on this host."""
    gpus = [g for g in facts.nvml.gpus if g.index in reserved] if reserved else []
    checks = _gpu_checks(spec, facts)
    if kind_of(spec).uses_torch(spec):
        checks.append(_torch_check(spec, facts, bool(gpus)))
    for gpu in gpus:
        free = gpu.memory_free_mib / max(gpu.memory_total_mib, 1)
        if free < 0.5:
            checks.append(
                Check(
                    name=f"gpu{gpu.index}-memory",
                    level="warn",
                    message=f"GPU {gpu.index} has only {gpu.memory_free_mib:.0f} MiB of"
                    f" {gpu.memory_total_mib:.0f} MiB free; another process is using it.",
                )
            )
    checks += _disk_checks(spec, facts)
    checks += _host_size_checks(spec, facts)
    needs = kind_of(spec).needs(spec)
    for field, program in [*needs.programs.items(), *needs.host_programs.items()]:
        if spec.image is not None and field in needs.programs:  # looked up in it when pinned
            checks.append(
                Check(
                    name="program",
                    level="pass",
                    message=f"{field}: {program} is in the image {spec.image.pinned}.",
                )
            )
            continue
        found = resolve_program(program, spec.env.get("PATH") or os.environ.get("PATH"))
        checks.append(
            Check(
                name="program",
                level="pass" if found else "fail",
                message=f"{field}: {program} is {found}."
                if found
                else f"{field}: {program!r} was not found here; install it or give its full path"
                + (
                    " (or job.python: gpuflow, the Python gpuflow runs from)."
                    if program.startswith("python") and "/" not in program
                    else "."
                ),
            )
        )
    if facts.nccl_env:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(facts.nccl_env.items()))
        checks.append(Check(name="nccl", level="pass", message=f"NCCL settings: {shown}."))

    levels = {c.level for c in checks}
    overall: Level = "fail" if "fail" in levels else "warn" if "warn" in levels else "pass"
    return PreflightReport(verdict=overall, checks=checks, facts=facts, gpus_reserved=reserved)


def _gpu_checks(spec: JobSpec, facts: HostFacts) -> list[Check]:
    """Return what NVML says of this host's GPUs and driver against what the job asks."""
    checks: list[Check] = []
    res = spec.resources
    wants_gpu = res.gpus > 0
    if facts.nvml.available and facts.nvml.gpus:
        names = ", ".join(
            f"{g.index}: {g.name} ({g.memory_total_mib / 1024:.0f} GiB)" for g in facts.nvml.gpus
        )
        checks.append(Check(name="gpus", level="pass", message=f"GPUs seen: {names}."))
    elif wants_gpu and not res.allow_cpu:
        checks.append(
            Check(
                name="gpus",
                level="fail",
                message=f"the job needs {res.gpus} GPU(s) but none is usable here: {facts.nvml.reason};"
                " run it on a GPU host or set resources.allow_cpu: true.",
            )
        )
    elif wants_gpu:
        checks.append(
            Check(
                name="gpus",
                level="warn",
                message=f"no GPU here ({facts.nvml.reason}); continuing on CPU as"
                " resources.allow_cpu allows.",
            )
        )
    else:
        checks.append(Check(name="gpus", level="pass", message="the job asks for no GPU."))

    if facts.nvml.available:
        checks.append(
            Check(
                name="driver",
                level="pass",
                message=f"NVIDIA driver {facts.nvml.driver_version}, CUDA {facts.nvml.cuda_driver_version}.",
            )
        )
    if wants_gpu and facts.nvml.available and facts.nvidia_smi is None:
        checks.append(
            Check(
                name="nvidia-smi",
                level="warn",
                message="nvidia-smi is not on PATH; install the NVIDIA utilities to debug on this host.",
            )
        )
    return checks


def _disk_checks(spec: JobSpec, facts: HostFacts) -> list[Check]:
    """Return the workspace's free disk against resources.disk (none when not known)."""
    if facts.disk_free_bytes is None:
        return []
    need = spec.resources.disk
    ok = facts.disk_free_bytes >= need
    short = f", less than resources.disk ({format_bytes(need)}); free space or lower it."
    return [
        Check(
            name="disk",
            level="pass" if ok else "fail",
            message=f"{format_bytes(facts.disk_free_bytes)} free in the workspace"
            + ("." if ok else short),
        )
    ]


def _host_size_checks(spec: JobSpec, facts: HostFacts) -> list[Check]:
    """Return checks of the host's cores, memory and /dev/shm against what the job asks."""
    res = spec.resources
    checks = []
    if res.cpu and facts.cpu_count and facts.cpu_count < res.cpu:
        checks.append(
            Check(
                name="cpu",
                level="warn",
                message=f"the job asks for {res.cpu:g} CPU cores but this host gives it"
                f" {facts.cpu_count}; it will run slower than planned.",
            )
        )
    if res.memory and facts.memory_total_bytes and facts.memory_total_bytes < res.memory:
        checks.append(
            Check(
                name="memory",
                level="fail",
                message=f"the job asks for {format_bytes(res.memory)} of memory but this host has"
                f" {format_bytes(facts.memory_total_bytes)}; lower resources.memory or use a"
                " bigger host.",
            )
        )
    if res.shm and facts.shm_total_bytes is not None and facts.shm_total_bytes < res.shm:
        checks.append(
            Check(
                name="shm",
                level="warn",
                message=f"/dev/shm is {format_bytes(facts.shm_total_bytes)}, less than"
                f" resources.shm ({format_bytes(res.shm)}); DataLoader workers and NCCL may fail"
                " with bus errors: remount it larger or lower num_workers.",
            )
        )
    return checks


def _torch_check(spec: JobSpec, facts: HostFacts, have_gpu: bool) -> Check:
    torch = facts.torch
    if torch.version is None and torch.python is not None and spec.image is not None:
        return Check(
            name="torch",
            level="fail",
            message=f"job.command: the python3 of the image {spec.image.pinned} cannot import"
            f" torch ({torch.import_error}); install in the image a torch built for a CUDA"
            f" this host's driver supports.",
        )
    if torch.version is None and torch.python is not None:
        return Check(
            name="torch",
            level="fail",
            message=f"job.command: the job's Python {torch.python} cannot import torch"
            f" ({torch.import_error}); install torch for it, or set job.python: gpuflow to run"
            f" the Python gpuflow runs from ({sys.executable}), or the path of another.",
        )
    if torch.version is None:
        return Check(
            name="torch",
            level="fail",
            message="torch is not installed; pip install 'gpuflow[train]'.",
        )
    finding = compat.check(
        torch.cuda_build, facts.nvml.cuda_driver_version, facts.nvml.driver_version
    )
    level: Level = finding.level
    message = f"torch {torch.version}: {finding.message}"
    if torch.python is not None:
        message = f"torch {torch.version} (as {torch.python} imports it): {finding.message}"
    if not have_gpu:
        # On a CPU host a CPU build is what we expect.
        level = "pass" if finding.level != "fail" else "warn"
        asked = f" (as {torch.python} imports it)" if torch.python else ""
        message = f"torch {torch.version}{asked} will run on CPU."
    elif torch.cuda_available is False:
        level = "fail" if not spec.resources.allow_cpu else "warn"
        message += " torch.cuda.is_available() is False; " + (
            "fix the CUDA install or set resources.allow_cpu: true."
            if level == "fail"
            else "continuing on CPU."
        )
    return Check(name="torch", level=level, message=message)
