"""Shared fixtures: a fake NVML, an isolated GPUFLOW_HOME, and one Prefect server per session."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FAKES = Path(__file__).parent / "fakes"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


def load_fake_nvml(**config) -> ModuleType:
    """Return a fresh fake pynvml module with `config` overriding its defaults."""
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKES / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.config.update(config)
    return module


@pytest.fixture
def fake_nvml(monkeypatch) -> ModuleType:
    """A 2-GPU H100 host as far as gpuflow's `import pynvml` can tell."""
    module = load_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def no_nvml(monkeypatch) -> ModuleType:
    """A host without the NVIDIA driver, whatever this machine has."""
    module = load_fake_nvml(mode="missing")
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture(autouse=True)
def gpuflow_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "gpuflow-home"
    monkeypatch.setenv("GPUFLOW_HOME", str(home))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return home


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """One Prefect server (SQLite) for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture
def gpu_limit(prefect_api) -> Iterator[str]:
    """A global concurrency limit `gpu` of 2 slots, removed afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpu", limit=2))
    yield "gpu"
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name("gpu")


def subprocess_env(api_url: str, home: Path, fake_gpus: int | None = None) -> dict[str, str]:
    """Return an environment for a `gpuflow` subprocess talking to the test server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(home), PREFECT_LOGGING_LEVEL="INFO")
    if fake_gpus is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(FAKES), env.get("PYTHONPATH", "")])
        env["FAKE_NVML_GPUS"] = str(fake_gpus)
    return env
