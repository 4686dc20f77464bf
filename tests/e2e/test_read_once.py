"""A run is configured once: its spec is checked once (the CLI's check is the flow's),
its backend's block is read once and its secrets are resolved once, from the check to
teardown. Counted at the edges: a backend registered here counts its own `configure` and
`check` calls and reads its block as a real one does; block reads are counted where
Prefect's client fetches a block document."""

from __future__ import annotations

import collections
import sys

import pytest
from prefect.blocks.core import Block

from gpuflow.tasks.backends import registry
from gpuflow.tasks.contract import Needs
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import JobSpec
from tests.e2e.toy_backend import ToyBackend

pytestmark = pytest.mark.e2e
CALLS: collections.Counter[str] = collections.Counter()


class CountedBackend(ToyBackend):
    name = "counted"

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        from gpuflow.blocks import LocalGpuHost
        from gpuflow.tasks.saved_blocks import load_block

        CALLS["configure"] += 1
        load_block(LocalGpuHost, spec.placement.block or "", "placement.block")
        return spec, prices

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        CALLS["check"] += 1
        super().check(spec, needs)


@pytest.fixture
def counted(monkeypatch, prefect_api):
    from prefect.blocks.system import Secret

    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost().save("counted-host", overwrite=True)
    Secret(value="tok-7d1e-counted").save("counted-token", overwrite=True)
    loads: collections.Counter[str] = collections.Counter()
    read = Block._get_block_document.__func__  # Prefect's client: one API request each

    def counting(cls, name, *args, **kwargs):
        loads[f"{cls.__name__}/{name}"] += 1
        return read(cls, name, *args, **kwargs)

    monkeypatch.setattr(Block, "_get_block_document", classmethod(counting))
    registry.register(CountedBackend)
    CALLS.clear()
    yield loads
    registry.unregister("counted")


def spec(name: str) -> dict:
    return {
        "name": name,
        "job": {"kind": "command", "command": [sys.executable, "-c", "print('counted')"]},
        "placement": {"backend": "counted", "block": "counted-host"},
        "secret_env": {"TOKEN": "counted-token"},
    }


def test_a_run_from_the_cli_checks_reads_and_resolves_once(counted, tmp_path, gpuflow_home):
    import yaml

    from gpuflow.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec("once")))
    assert main(["run", str(path)]) == 0
    assert dict(CALLS) == {"configure": 1, "check": 1}
    assert dict(counted) == {"LocalGpuHost/counted-host": 1, "Secret/counted-token": 1}


def test_each_of_several_runs_is_checked_once_and_reads_its_own(counted, gpuflow_home):
    from gpuflow import gpu_jobs

    runs = gpu_jobs([spec("first"), spec("second")])
    assert [r.exit_code for r in runs] == [0, 0]
    assert dict(CALLS) == {"configure": 2, "check": 2}  # a run each, not one for both
    assert dict(counted) == {"LocalGpuHost/counted-host": 2, "Secret/counted-token": 2}
