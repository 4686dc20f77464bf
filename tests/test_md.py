"""The MD kernel's physics: forces against a naive O(N^2) loop, the split of pairs over
ranks, energy conservation over 1,000 steps."""

from __future__ import annotations

import pytest
import torch

from gpuflow.tasks.hpc import md
from gpuflow.tasks.hpc.box import box_for, ns_per_day
from gpuflow.tasks.hpc.md_run import simulate

# Velocity Verlet with dt 0.005 and a shifted cutoff of 2.5 keeps the total energy within
# ~2e-4 epsilon per atom over 1,000 steps of the triple-point liquid; the bound leaves 5x.
DRIFT_BOUND_PER_ATOM = 1e-3


def jiggled(atoms: int, density: float = 0.8442, seed: int = 0):
    box = box_for(atoms, density, 2.5, 0.3)
    gen = torch.Generator().manual_seed(seed)
    x = md.lattice(box) + 0.1 * torch.randn(atoms, 3, generator=gen, dtype=torch.float64)
    return box, x


@pytest.mark.parametrize(
    ("atoms", "path"),
    [(256, "all pairs: under 3 cells a side"), (600, "cell list: 3 cells a side")],
)
def test_forces_match_the_naive_double_loop(atoms, path):
    box, x = jiggled(atoms)
    assert (int(box.length // (box.cutoff + box.skin)) >= 3) == path.startswith("cell")
    i, j = md.neighbour_pairs(x, box)
    forces, energy, _ = md.pair_forces(x, box, i, j)
    reference, reference_energy = md.naive_forces(x, box)
    assert torch.allclose(forces, reference, rtol=0, atol=1e-9)
    assert float(energy) == pytest.approx(reference_energy, rel=1e-12)
    assert torch.allclose(forces.sum(dim=0), torch.zeros(3, dtype=x.dtype), atol=1e-9)


@pytest.mark.parametrize("atoms", [256, 2048])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_ranks_share_the_pairs_without_overlap(atoms, parts):
    box, x = jiggled(atoms)
    whole = set(zip(*(t.tolist() for t in md.neighbour_pairs(x, box)), strict=True))
    shares = [
        list(zip(*(t.tolist() for t in md.neighbour_pairs(x, box, p, parts)), strict=True))
        for p in range(parts)
    ]
    joined = [pair for share in shares for pair in share]
    assert len(joined) == len(set(joined))  # no pair twice
    assert {tuple(sorted(p)) for p in joined} == {tuple(sorted(p)) for p in whole}
    assert all(share for share in shares)


def test_lattice_and_velocities():
    box = box_for(500, 0.8442, 2.5, 0.3)
    x = md.lattice(box)
    assert x.shape == (500, 3) and float(x.min()) >= 0 and float(x.max()) < box.length
    d = x[:, None, :] - x[None, :, :]
    d -= box.length * torch.round(d / box.length)
    r = (d**2).sum(-1).sqrt() + torch.eye(500, dtype=x.dtype) * 99
    assert float(r.min()) > 0.9  # no overlapping atoms
    v = md.velocities(500, 1.3, seed=4)
    assert md.kinetic_temperature(v) == pytest.approx(1.3, rel=1e-12)
    assert torch.allclose(v.sum(dim=0), torch.zeros(3, dtype=v.dtype), atol=1e-10)


def test_total_energy_is_conserved_over_1000_steps():
    run = simulate({"atoms": 500, "steps": 1000, "thermo_every": 50}, torch.device("cpu"))
    assert run["steps"] == 1000 and len(run["thermo"]) == 21
    assert abs(run["max_energy_deviation_per_atom"]) < DRIFT_BOUND_PER_ATOM
    temperatures = [row["temperature"] for row in run["thermo"]]
    assert temperatures[0] == pytest.approx(0.72)
    assert 0.2 < temperatures[-1] < 0.72  # the lattice melts: kinetic energy turns potential
    assert run["neighbour_rebuilds"] > 0
    assert run["atom_steps_per_s"] > 0 and run["ns_per_day"] > 0


def test_a_step_too_large_shows_up_as_drift():
    """The drift measure can fail: a step 4x the default heats the fluid visibly."""
    run = simulate({"atoms": 500, "steps": 250, "dt": 0.02}, torch.device("cpu"))
    assert abs(run["max_energy_deviation_per_atom"]) > DRIFT_BOUND_PER_ATOM


def test_box_too_small_and_ns_per_day():
    with pytest.raises(ValueError, match=r"too small for cutoff 2.5 \+ skin 0.3; use at least"):
        box_for(100, 0.8442, 2.5, 0.3)
    # 1000 steps of 0.005 tau = 10.78 ps of argon; in one second that is 931.7 ns/day
    assert ns_per_day(1000, 0.005, 1.0) == pytest.approx(931.67, rel=1e-3)
