"""NVML (nvidia-ml-py) behind a few functions that never raise on a host without GPUs.

Tests pass a fake module with the same names; production loads `pynvml`.
"""

from __future__ import annotations

import importlib
import logging
import os
import types
from typing import Any

from pydantic import BaseModel

from gpuflow.tasks.compat import cuda_from_nvml
from gpuflow.tasks.gpus import product_from_nvml_name

logger = logging.getLogger(__name__)


class GpuInfo(BaseModel):
    index: int
    name: str
    product: str
    uuid: str
    memory_total_mib: float
    memory_free_mib: float


class NvmlStatus(BaseModel):
    available: bool
    reason: str = ""
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: list[GpuInfo] = []


def load_nvml(module: types.ModuleType | None = None) -> Any:
    """Return the NVML module to use: the one given, else `pynvml`, else None."""
    if module is not None:
        return module
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(nvml: Any, exc: Exception) -> str:
    code = getattr(exc, "value", None)
    if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", object()):
        return "the NVML library (libnvidia-ml.so) was not found: no NVIDIA driver is installed"
    if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", object()):
        return "the NVIDIA driver is installed but not loaded; load it (modprobe nvidia) or reboot"
    if code == getattr(nvml, "NVML_ERROR_NO_PERMISSION", object()):
        return "no permission to talk to the NVIDIA driver; check /dev/nvidia* permissions"
    return f"NVML failed to start: {exc}"


def visible_indices(count: int) -> list[int]:
    """Return the device indices this process may use, honouring CUDA_VISIBLE_DEVICES."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    picked = []
    for part in value.split(","):
        part = part.strip()
        if part.isdigit() and int(part) < count:
            picked.append(int(part))
    return picked


def query(module: types.ModuleType | None = None) -> NvmlStatus:
    """Return the driver versions and GPU inventory, or why there is none."""
    nvml = load_nvml(module)
    if nvml is None:
        return NvmlStatus(available=False, reason="nvidia-ml-py is not installed")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses differ between versions
        return NvmlStatus(available=False, reason=_reason(nvml, exc))
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for index in visible_indices(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=name,
                    product=product_from_nvml_name(name),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    memory_total_mib=memory.total / 2**20,
                    memory_free_mib=memory.free / 2**20,
                )
            )
        return NvmlStatus(
            available=True,
            driver_version=driver,
            cuda_driver_version=cuda_from_nvml(cuda),
            gpus=gpus,
            reason="" if gpus else "the NVIDIA driver is loaded but reports no GPUs",
        )
    except Exception as exc:
        return NvmlStatus(available=False, reason=_reason(nvml, exc))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            logger.debug("nvmlShutdown failed", exc_info=True)
