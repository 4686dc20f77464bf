"""The `job:` section of an HPC spec (kind `hpc`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gpuflow.tasks.hpc.box import MAX_DENSITY, MAX_TEMPERATURE, box_for
from gpuflow.tasks.hpc.mpi import Host
from gpuflow.tasks.spec import SpecModel, StorageUrl, split_argv


class MdSettings(SpecModel):
    """The built-in workload: a Lennard-Jones fluid (reduced units; argon for ns/day)."""

    atoms: int = Field(4000, ge=32, le=20_000_000, description="Atoms in the periodic box.")
    density: float = Field(0.8442, description="Number density rho* in sigma^-3 (liquid ~0.8).")
    temperature: float = Field(0.72, description="Initial temperature T* in epsilon/kB.")
    cutoff: float = Field(2.5, ge=1.5, le=6.0, description="Interaction cutoff in sigma.")
    skin: float = Field(0.3, gt=0, le=2.0, description="Neighbour-list skin in sigma.")
    dt: float = Field(0.005, gt=0, le=0.02, description="Time step in reduced time units.")
    steps: int = Field(1000, ge=1, le=100_000_000)
    thermo_every: int = Field(50, ge=1, description="Steps between thermo rows.")
    seed: int = Field(1, description="Seed of the initial velocities.")
    dtype: Literal["float64", "float32"] = "float64"
    compare_cpu: bool = Field(
        True, description="On a GPU, also time the same system on the CPU for a speedup."
    )
    cpu_steps: int = Field(100, ge=1, description="Steps of that CPU comparison run.")

    @field_validator("density")
    @classmethod
    def _density(cls, value: float) -> float:

        if not 0 < value <= MAX_DENSITY:
            raise ValueError(
                f"{value} is outside the fluid and solid range (0, {MAX_DENSITY}] sigma^-3;"
                " use e.g. 0.8442 for the liquid near its triple point"
            )
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:

        if not 0 < value <= MAX_TEMPERATURE:
            raise ValueError(
                f"{value} is outside (0, {MAX_TEMPERATURE}] epsilon/kB, where a step of 0.005"
                " stays stable; use e.g. 0.72 (argon's liquid at about 86 K)"
            )
        return value

    @model_validator(mode="after")
    def _box_fits_cutoff(self) -> MdSettings:

        try:
            box_for(self.atoms, self.density, self.cutoff, self.skin)
        except ValueError as exc:
            raise ValueError(f"job.md.atoms: {exc}") from None
        return self


class HpcJob(SpecModel):
    """An MPI job: optional inputs and build step, then mpirun of a program (or the
    built-in molecular-dynamics workload) across ranks; outputs uploaded."""

    kind: Literal["hpc"] = "hpc"
    program: list[str] | None = Field(
        None, description="The program each rank runs, e.g. [./md, --steps, 1000]."
    )
    md: MdSettings | None = Field(None, description="Run the built-in MD workload instead.")
    build: list[str] | None = Field(
        None, description="Run once in the workspace before mpirun, e.g. [make, -j4]."
    )
    inputs: list[StorageUrl] = Field(
        default_factory=list, description="Objects or prefixes fetched into the workspace."
    )
    output: StorageUrl | None = Field(
        None, description="Prefix the outputs folder is uploaded to when the job ends."
    )
    ranks: int = Field(1, ge=1, le=65536, description="MPI processes (mpirun -np).")
    hosts: list[Host] | None = Field(
        None, description="Hosts mpirun reaches by ssh; default: this host."
    )
    slots: int | None = Field(
        None, ge=1, le=4096, description="Ranks this host takes; default: its CPU cores."
    )
    gpus_per_rank: int = Field(0, ge=0, le=64, description="GPUs each rank owns.")
    oversubscribe: bool = Field(False, description="Allow more ranks than slots.")
    mpirun: str = Field("mpirun", description="The mpirun program: a name on PATH or a path.")
    mpirun_args: list[str] = Field(
        default_factory=list, description="Extra mpirun options, e.g. [--mca, btl, tcp,self]."
    )
    torch: bool = False

    _split_program = field_validator("program", "build", mode="before")(
        classmethod(lambda cls, value: split_argv(value))
    )

    @field_validator("program", "build")
    @classmethod
    def _not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not value[0].strip()):
            raise ValueError("is empty; give a program and its arguments, e.g. [make, -j4]")
        return value

    @model_validator(mode="after")
    def _one_program(self) -> HpcJob:
        if (self.program is None) == (self.md is None):
            raise ValueError(
                "job.program and job.md: give exactly one, your MPI program or md: {} for the"
                " built-in molecular-dynamics workload"
            )
        return self
