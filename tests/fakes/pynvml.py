"""A fake `pynvml` with the calls gpuflow makes, configured from FAKE_NVML_* variables.

Put this folder first on PYTHONPATH (or in sys.modules) to stand in for the real one:
FAKE_NVML_MODE      ok | missing | not_loaded        (default ok)
FAKE_NVML_GPUS      how many GPUs                     (default 2)
FAKE_NVML_NAME      device name                       (default "NVIDIA H100 80GB HBM3")
FAKE_NVML_DRIVER    driver version                    (default 550.54.14)
FAKE_NVML_CUDA      CUDA driver version as NVML gives it (default 12040)
FAKE_NVML_FREE_MIB  free memory per GPU               (default 80000)
FAKE_NVML_UTIL      GPU utilisation in %              (default 87 + the GPU's index)
"""

from __future__ import annotations

import os
from types import SimpleNamespace

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
TOTAL_MIB = 81559


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


config = {
    "mode": os.environ.get("FAKE_NVML_MODE", "ok"),
    "gpus": int(os.environ.get("FAKE_NVML_GPUS", "2")),
    "name": os.environ.get("FAKE_NVML_NAME", "NVIDIA H100 80GB HBM3"),
    "driver": os.environ.get("FAKE_NVML_DRIVER", "550.54.14"),
    "cuda": int(os.environ.get("FAKE_NVML_CUDA", "12040")),
    "free_mib": float(os.environ.get("FAKE_NVML_FREE_MIB", "80000")),
    "util": float(os.environ["FAKE_NVML_UTIL"]) if "FAKE_NVML_UTIL" in os.environ else None,
}
calls = {"init": 0, "shutdown": 0}
_energy = {}


def nvmlInit() -> None:
    calls["init"] += 1
    if config["mode"] == "missing":
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    if config["mode"] == "not_loaded":
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)


def nvmlShutdown() -> None:
    calls["shutdown"] += 1


def nvmlSystemGetDriverVersion() -> str:
    return config["driver"]


def nvmlSystemGetCudaDriverVersion() -> int:
    return config["cuda"]


def nvmlDeviceGetCount() -> int:
    return config["gpus"]


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if index >= config["gpus"]:
        raise NVMLError(2)
    return index


def nvmlDeviceGetName(handle: int) -> str:
    return config["name"]


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-0000000{handle}-fake-uuid"


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    free = config["free_mib"] * 2**20
    total = TOTAL_MIB * 2**20
    return SimpleNamespace(total=total, free=free, used=total - free)


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    util = config["util"]
    return SimpleNamespace(gpu=87 + handle if util is None else util, memory=40)


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return 350_000  # mW


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return 61


def nvmlDeviceGetClockInfo(handle: int, clock: int) -> int:
    return 1980


def nvmlDeviceGetTotalEnergyConsumption(handle: int) -> int:
    _energy[handle] = _energy.get(handle, 1_000_000) + 350_000  # +350 J a call
    return _energy[handle]
