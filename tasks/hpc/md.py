"""A Lennard-Jones fluid in a periodic box, in torch so it runs on CUDA or the CPU. Pure:
no MPI and no Prefect here; tasks/hpc/md_run.py splits the force loop over ranks.

Reduced units (sigma = epsilon = mass = 1). The potential is truncated at `cutoff` and
shifted so the energy is continuous there. Pairs come from a Verlet neighbour list (radius
cutoff + skin) built from a cell list, rebuilt when any atom has moved half the skin.
Velocity Verlet integrates; nothing rescales velocities, so total energy drift measures
the integration's accuracy.
"""

from __future__ import annotations

import math

import torch

from gpuflow.tasks.hpc.box import Box


def lattice(box: Box, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Return `box.atoms` positions on an FCC lattice filling the box (the first sites of
    the smallest lattice with enough of them)."""
    cells = math.ceil((box.atoms / 4) ** (1 / 3))
    a = box.length / cells
    base = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=dtype)
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(cells, dtype=dtype)] * 3, indexing="ij"), dim=-1
    ).reshape(-1, 1, 3)
    sites = ((grid + base) * a).reshape(-1, 3)
    return sites[: box.atoms].clone()


def velocities(
    atoms: int, temperature: float, seed: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Return Gaussian velocities with no net momentum, scaled to exactly `temperature`."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(atoms, 3, generator=gen, dtype=dtype)
    v -= v.mean(dim=0)
    return v * math.sqrt(temperature / kinetic_temperature(v))


def kinetic_energy(v: torch.Tensor) -> float:
    return 0.5 * float((v * v).sum())


def kinetic_temperature(v: torch.Tensor) -> float:
    """Return the temperature: 2 KE / (3N - 3) (momentum is conserved)."""
    return 2 * kinetic_energy(v) / (3 * v.shape[0] - 3)


def wrap(x: torch.Tensor, length: float) -> torch.Tensor:
    return x - length * torch.floor(x / length)


def _half_shell() -> list[tuple[int, int, int]]:
    """Return the 14 cell offsets whose pairs, taken once, cover every neighbour pair."""
    offsets = [(0, 0, 0)]
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            for dz in (-1, 0, 1):
                if (dx, dy, dz) > (0, 0, 0):
                    offsets.append((dx, dy, dz))
    return offsets


HALF_SHELL = _half_shell()


def neighbour_pairs(
    x: torch.Tensor, box: Box, part: int = 0, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return pairs (i, j) closer than cutoff + skin, each once. With `parts` > 1 only the
    pairs whose first cell falls in slice `part` of the cells: the parts together are the
    whole list, with no pair twice, so ranks can split the force loop by cells."""
    reach = box.cutoff + box.skin
    n = int(box.length // reach)
    if n < 3:  # too few cells for the half shell to be distinct: take all pairs
        i, j = torch.triu_indices(box.atoms, box.atoms, offset=1, device=x.device)
        keep = torch.arange(i.shape[0], device=x.device) % parts == part
        i, j = i[keep], j[keep]
        return _within(x, box, i, j, reach)
    cell3 = torch.clamp((wrap(x, box.length) / (box.length / n)).long(), max=n - 1)
    cell = (cell3[:, 0] * n + cell3[:, 1]) * n + cell3[:, 2]
    order = torch.argsort(cell, stable=True)
    counts = torch.bincount(cell, minlength=n**3)
    depth = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    sorted_cells = cell[order]
    slot = torch.arange(box.atoms, device=x.device) - starts[sorted_cells]
    table = torch.full((n**3, depth), -1, dtype=torch.long, device=x.device)
    table[sorted_cells, slot] = order
    # positions by (cell, slot); empty slots are NaN, which is never within reach
    pos = torch.full((n**3, depth, 3), float("nan"), dtype=x.dtype, device=x.device)
    pos[sorted_cells, slot] = x[order]
    first, last = part * n**3 // parts, (part + 1) * n**3 // parts
    mine = torch.arange(first, last, device=x.device)
    mx, my, mz = mine // (n * n), (mine // n) % n, mine % n
    upper = torch.ones(depth, depth, dtype=torch.bool, device=x.device).triu(1)
    mine_pos = pos[mine].unsqueeze(2)
    ii, jj = [], []
    for dx, dy, dz in HALF_SHELL:
        other = (((mx + dx) % n) * n + (my + dy) % n) * n + (mz + dz) % n
        d = _minimum_image(pos[other].unsqueeze(1) - mine_pos, box.length)
        close = (d * d).sum(dim=-1) < reach * reach
        if (dx, dy, dz) == (0, 0, 0):
            close &= upper  # pairs within a cell once
        c, a, b = close.nonzero(as_tuple=True)
        ii.append(table[mine[c], a])
        jj.append(table[other[c], b])
    return torch.cat(ii), torch.cat(jj)


def _within(
    x: torch.Tensor, box: Box, i: torch.Tensor, j: torch.Tensor, reach: float
) -> tuple[torch.Tensor, torch.Tensor]:
    d = _minimum_image(x[j] - x[i], box.length)
    keep = (d * d).sum(dim=1) < reach * reach
    return i[keep], j[keep]


def _minimum_image(d: torch.Tensor, length: float) -> torch.Tensor:
    return d - length * torch.round(d / length)


def pair_forces(
    x: torch.Tensor, box: Box, i: torch.Tensor, j: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (forces on every atom, potential energy, virial) from pairs (i, j), with the
    truncated and shifted Lennard-Jones potential. Energy and virial are 0-d tensors so
    that nothing leaves the device until the caller asks."""
    d = _minimum_image(x[j] - x[i], box.length)
    r2 = (d * d).sum(dim=1)
    inside = r2 < box.cutoff**2
    d, r2 = d[inside], r2[inside]
    inv6 = (1.0 / r2) ** 3
    shift = 4 * (box.cutoff**-12 - box.cutoff**-6)
    energy = (4 * inv6 * (inv6 - 1) - shift).sum()
    scale = 24 * inv6 * (2 * inv6 - 1) / r2  # F_j = scale * d, F_i = -F_j
    f = scale.unsqueeze(1) * d
    forces = torch.zeros_like(x)
    forces.index_add_(0, j[inside], f)
    forces.index_add_(0, i[inside], -f)
    virial = (scale * r2).sum()
    return forces, energy, virial


def naive_forces(x: torch.Tensor, box: Box) -> tuple[torch.Tensor, float]:
    """Return forces and potential energy by the plain O(N^2) double loop over pairs: the
    reference the fast path is checked against."""
    n = x.shape[0]
    forces = torch.zeros_like(x)
    energy = 0.0
    shift = 4 * (box.cutoff**-12 - box.cutoff**-6)
    for a in range(n):
        for b in range(a + 1, n):
            d = _minimum_image(x[b] - x[a], box.length)
            r2 = float((d * d).sum())
            if r2 >= box.cutoff**2:
                continue
            inv6 = (1.0 / r2) ** 3
            energy += 4 * inv6 * (inv6 - 1) - shift
            f = 24 * inv6 * (2 * inv6 - 1) / r2 * d
            forces[b] += f
            forces[a] -= f
    return forces, energy
