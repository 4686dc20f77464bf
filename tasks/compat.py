"""Driver / CUDA / torch compatibility: which driver a CUDA build needs, and what to do.

Minimum Linux driver per CUDA toolkit release, from NVIDIA's CUDA release notes
(table "CUDA Toolkit and Corresponding Driver Versions"). Pure: no NVML, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# CUDA (major, minor) -> minimum Linux driver for full support
MIN_DRIVER: dict[tuple[int, int], str] = {
    (11, 0): "450.51.06",
    (11, 1): "455.23",
    (11, 2): "460.27.03",
    (11, 3): "465.19.01",
    (11, 4): "470.42.01",
    (11, 5): "495.29.05",
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
# Minor-version compatibility: within a major release, this driver runs newer minors
# (PTX JIT and some newer features excepted).
MINOR_COMPAT_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

Level = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str


def parse_version(text: str) -> tuple[int, ...]:
    """Return a version string ('12.4', '550.54.14', '2.13.0+cu128') as a tuple of ints."""
    core = text.split("+", 1)[0]
    return tuple(int(p) for p in core.split(".") if p.isdigit())


def cuda_from_nvml(value: int) -> str:
    """Return NVML's integer CUDA driver version (12040) as '12.4'."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def cuda_from_torch_version(torch_version: str) -> str | None:
    """Return the CUDA build of a torch wheel from its local tag ('+cu128' -> '12.8')."""
    if "+cu" not in torch_version:
        return None
    digits = torch_version.split("+cu", 1)[1]
    return f"{digits[:-1]}.{digits[-1]}" if len(digits) >= 2 else None


def check(torch_cuda: str | None, driver_cuda: str | None, driver_version: str | None) -> Finding:
    """Return whether a torch CUDA build can run on this driver, with the fix in words."""
    if torch_cuda is None:
        return Finding(
            "warn", "torch is a CPU-only build; install a CUDA build of torch to use GPUs."
        )
    if driver_cuda is None or driver_version is None:
        return Finding(
            "warn", "no NVIDIA driver was found, so torch's CUDA build cannot be checked."
        )
    need = parse_version(torch_cuda)[:2]
    have = parse_version(driver_cuda)[:2]
    if need <= have:
        return Finding(
            "pass", f"torch CUDA {torch_cuda} runs on driver {driver_version} (CUDA {driver_cuda})."
        )
    minimum = MIN_DRIVER.get((need[0], need[1]), "a newer release")
    fix = (
        f"upgrade the NVIDIA driver to {minimum} or newer, or install a torch build for"
        f" CUDA {driver_cuda} or older"
    )
    compat = MINOR_COMPAT_DRIVER.get(need[0])
    if need[0] == have[0] and compat and parse_version(driver_version) >= parse_version(compat):
        return Finding(
            "warn",
            f"torch is built for CUDA {torch_cuda} but driver {driver_version} supports CUDA"
            f" {driver_cuda}; it runs under minor-version compatibility, but kernels needing PTX JIT"
            f" will fail: {fix}.",
        )
    return Finding(
        "fail",
        f"torch is built for CUDA {torch_cuda} but driver {driver_version} supports only CUDA"
        f" {driver_cuda}: {fix}.",
    )
