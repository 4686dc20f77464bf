"""gpuflow's extras: what `pip install gpuflow` leaves out, and the one sentence that names
the extra to install when a spec needs one that is missing here (before anything is made).

The table is pyproject.toml's [project.optional-dependencies], by the modules each brings.
"""

from __future__ import annotations

import importlib.util

from gpuflow.tasks.errors import InvalidSpec

# extra -> the modules it installs (import names), as pyproject.toml lists them
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("torch", "webdataset"),
    "aws": ("boto3", "prefect_aws"),
    "alibaba": ("alibabacloud_ecs20140526", "boto3"),
    "tencent": ("tencentcloud", "boto3"),
    "kubernetes": ("prefect_kubernetes",),
    "hpc": ("mpi4py", "torch"),
    "stream": ("av",),
}


def installed(module: str) -> bool:
    """Return True when `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package, or a refusing finder
        return False


def missing(extra: str) -> list[str]:
    """Return the modules of `extra` that are not installed here."""
    return [module for module in EXTRAS[extra] if not installed(module)]


def require(extra: str | None, field: str, what: str) -> None:
    """Raise InvalidSpec naming the extra to install when `what` (the spec's `field`) needs
    `extra` and any of its modules is missing; nothing when `extra` is None."""
    if extra is None:
        return
    lacking = missing(extra)
    if lacking:
        raise InvalidSpec(
            f"{field}: {what} needs {' and '.join(lacking)}, which this gpuflow was installed"
            f" without; install its extra: pip install 'gpuflow[{extra}]'."
        )
