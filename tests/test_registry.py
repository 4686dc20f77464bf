"""A backend and a kind are their own code plus one `register` call: every list gpuflow
keeps of them (reap's backends, the public names, prices, block types, offers, preflight)
reads the registry, so one registered here, in the test, is seen everywhere."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal

import pytest
from pydantic import BaseModel

import gpuflow
from gpuflow.tasks.backends import registry
from gpuflow.tasks.backends.base import UnitBackend
from gpuflow.tasks.kinds import registry as kinds
from gpuflow.tasks.kinds.command import CommandJob, CommandKind
from gpuflow.tasks.metrics.cost import ListPrices, PriceTable
from gpuflow.tasks.spec import JOB_MODELS, PLACEMENT_MODELS, Placement, load_spec
from tests.conftest import subprocess_env
from tests.e2e.toy_backend import ToyBackend


class BenchPlacement(Placement):
    shelf: str = "top"


class BenchBlock(BaseModel):
    """Stands for the Prefect block type such a backend keeps its settings in."""


class BenchBackend(ToyBackend):
    name = "bench"
    placement_model = BenchPlacement
    list_prices = ListPrices(gpu_hourly_usd={"*": 1.25})

    @classmethod
    def block_types(cls) -> list[type]:
        return [BenchBlock]


class EchoJob(CommandJob):
    kind: Literal["echo"] = "echo"  # type: ignore[assignment]
    command: list[str] = ["echo", "hi"]  # type: ignore[assignment]


class EchoKind(CommandKind):
    name = "echo"
    model = EchoJob  # type: ignore[assignment]


@pytest.fixture
def registered():
    registry.register(BenchBackend)
    kinds.register(EchoKind())
    yield
    registry.unregister("bench")
    kinds.unregister("echo")


def test_a_backend_and_a_kind_registered_here_are_in_every_list(registered, prefect_api):
    from gpuflow.cli import main
    from gpuflow.tasks.platform.blocks_setup import defaults

    assert "bench" in registry.names() and "echo" in kinds.names()
    assert gpuflow.BenchPlacement is BenchPlacement and gpuflow.EchoJob is EchoJob
    assert PriceTable().gpu_hourly("bench", "any product") == 1.25
    assert BenchBlock in [block for block, _, _ in defaults()]
    assert isinstance(registry.reaper("bench", None, None), BenchBackend)
    assert main(["reap", "--backend", "bench", "--dry-run"]) == 0  # a --backend it accepts
    spec = {"name": "b", "job": {"kind": "echo"}, "placement": {"backend": "bench"}}
    [(candidate, offers)] = gpuflow.offers(spec)
    assert not candidate.error and [o.where for o in offers] == ["this machine, as toy processes"]
    loaded = load_spec({**spec, "placement": {"backend": "bench", "shelf": "low"}})
    assert isinstance(loaded.placement, BenchPlacement) and loaded.placement.shelf == "low"
    assert loaded.job.kind == "echo"


def test_unregistered_they_are_gone_from_every_list(registered):
    registry.unregister("bench")
    kinds.unregister("echo")
    assert "bench" not in registry.names() and "bench" not in PLACEMENT_MODELS
    assert "echo" not in kinds.names() and "echo" not in JOB_MODELS
    with pytest.raises(AttributeError):
        _ = gpuflow.BenchPlacement
    with pytest.raises(gpuflow.InvalidSpec, match=r"--backend: 'bench' is not a backend; use one"):
        registry.reaper("bench", None, None)
    assert "bench" not in PriceTable().gpu_hourly_usd


def test_every_built_in_model_is_a_public_name():
    """The public names list every registered kind's job model and backend's placement
    model (a built-in one missing from them fails here)."""
    models = {m.__name__ for m in [*JOB_MODELS.values(), *PLACEMENT_MODELS.values()]}
    assert models - set(gpuflow.__all__) == set()
    for name in models:
        assert getattr(gpuflow, name).__name__ == name


def test_every_backend_implements_every_verb():
    """A backend class that leaves a verb out cannot be made (and mypy says so)."""

    class Half(UnitBackend):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
    for name in registry.names():
        assert not getattr(registry.backend_class(name), "__abstractmethods__", None), name


@pytest.mark.parametrize("backend", registry.names())
def test_preflight_of_every_backend_is_rows_or_one_sentence(
    backend, tmp_path, gpuflow_home, prefect_api
):
    """`gpuflow preflight` of a spec on each registered backend, none of them set up here:
    rows, or one sentence saying what to set up; never a traceback."""
    spec = tmp_path / "job.yaml"
    extra = ", fleet: nowhere" if backend == "fleet" else ""
    spec.write_text(
        "name: p\njob: {kind: command, command: ['true']}\nresources: {gpus: 1, allow_cpu: true}\n"
        f"placement: {{backend: {backend}{extra}}}\n"
    )
    env = {**subprocess_env(prefect_api, gpuflow_home), "KUBECONFIG": str(tmp_path / "none")}
    env.pop("SLURM_CONF", None)
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "preflight", str(spec)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert "Traceback" not in said and "Error:" not in said, said
    if done.returncode == 2:
        [sentence] = [line for line in done.stderr.splitlines() if line.startswith("gpuflow:")]
        assert sentence.startswith("gpuflow: invalid input: placement"), sentence
    else:
        assert done.returncode in (0, 1) and "verdict: " in done.stdout, said


def test_a_backend_that_says_it_adds_nodes_must_have_the_verbs():
    """Capabilities are checked against the verbs when a backend is registered."""
    from gpuflow.tasks.contract import Capabilities

    class Boasting(ToyBackend):
        name = "boasting"
        capabilities = Capabilities(runs_here=True, where="here", adds_nodes=True)

    with pytest.raises(TypeError, match="'boasting' says it can but lacks AddsNodes"):
        registry.register(Boasting)
    assert "boasting" not in registry.names()


def test_the_import_contract_keeps_every_built_in_backend_apart():
    """import-linter's contract is static text: it must name every built-in backend's
    package (a backend added without it fails here)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    [apart] = [c for c in config["contracts"] if c["type"] == "independence"]
    packages = {registry.backend_class(n).__module__.rsplit(".", 1)[0] for n in registry.BUILT_IN}
    assert set(apart["modules"]) == packages
