"""The MD workload's box and the physical limits of its inputs. Pure, and free of torch so
that a spec can be checked without loading it."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Argon, to turn reduced time into physical time for ns/day.
ARGON_TAU_PS = 2.1564  # sqrt(m sigma^2 / epsilon) for sigma 3.405 A, epsilon/kB 119.8 K, 39.948 u

# Beyond these the workload is not a fluid gpuflow can integrate with its fixed step.
MAX_DENSITY = 1.2  # the LJ solid melts near 1.0; past ~1.2 atoms overlap
MAX_TEMPERATURE = 10.0  # hotter than this, a step of 0.005 is no longer stable


@dataclass(frozen=True)
class Box:
    atoms: int
    length: float
    cutoff: float
    skin: float

    @property
    def volume(self) -> float:
        return self.length**3


def box_for(atoms: int, density: float, cutoff: float, skin: float) -> Box:
    """Return the cubic box holding `atoms` at `density`; ValueError when it is too small
    for the cutoff (the minimum image needs cutoff + skin < half the box)."""
    length = (atoms / density) ** (1 / 3)
    if cutoff + skin >= length / 2:
        need = math.ceil(density * (2 * (cutoff + skin)) ** 3) + 1
        raise ValueError(
            f"the box ({length:.2f} sigma) is too small for cutoff {cutoff} + skin {skin};"
            f" use at least {need} atoms or a smaller cutoff"
        )
    return Box(atoms=atoms, length=length, cutoff=cutoff, skin=skin)


def ns_per_day(steps: int, dt: float, seconds: float) -> float:
    """Return simulated nanoseconds per wall-clock day, in argon's time unit."""
    return steps * dt * ARGON_TAU_PS / 1000 / seconds * 86400
