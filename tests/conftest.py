"""Shared fixtures: a fake NVML, an isolated GPUFLOW_HOME, and one Prefect server per session."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import gpuflow.tasks.pipeline.plugins  # noqa: F401 - the built-in kinds and backends, for the spec

FAKES = Path(__file__).parent / "fakes"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# A temporary API stops with the command that started it, unless a test keeps it (the
# kept API has tests of its own: tests/e2e/test_kept_api.py); none outlives the suite.
os.environ.setdefault("GPUFLOW_API_IDLE_S", "0")


# Tests run in parallel (pytest-xdist, `--dist loadgroup`, scripts/test.sh): each worker
# starts its own Prefect server and S3 server once. A test that needs the Kubernetes test
# cluster joins the group `kubernetes`, so one worker starts one cluster for all of them
# (the Slurm tests: two groups, a cluster each, see below; the real node's tests: a cluster
# with a real node);
# a module with a module-scoped fixture (a platform, a data set) runs on one worker.
# Groups expected to run longest are handed out first, so they do not end the run alone.
# (the real node's group is not among them: its image import and containers would load the
# machine while the Slurm requeue tests wait on their timing)
FIRST = ("kubernetes", "slurm-requeue", "slurm")


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return (marker.args or [marker.kwargs.get("name")])[0] if marker else None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _group(item) is not None:
            continue
        if "testbed" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("kubernetes"))
        elif "real_node" in item.fixturenames:  # a test cluster of its own, with a real node
            item.add_marker(pytest.mark.xdist_group("kubernetes-real-node"))
        elif "image_registry" in item.fixturenames:  # one registry, one engine's store
            item.add_marker(pytest.mark.xdist_group("images"))
        elif "slurm_testbed" in item.fixturenames:
            # two groups, each on a worker with its own Slurm test cluster: the tests that
            # wait for Slurm to requeue a job, and the others
            waits = any(word in item.name for word in ("preempt", "taken", "urgent"))
            item.add_marker(pytest.mark.xdist_group("slurm-requeue" if waits else "slurm"))
        elif any(
            defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values()
        ):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # stable: collection order within each rank
    items.sort(key=lambda item: FIRST.index(g) if (g := _group(item)) in FIRST else len(FIRST))


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FREE_PORT = _load("free_port", Path(__file__).parents[1] / "scripts" / "testbed" / "free_port.py")


def load_fake_nvml(**config) -> ModuleType:
    """Return a fresh fake pynvml module with `config` overriding its defaults."""
    module = _load("fake_pynvml", FAKES / "pynvml.py")
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


@pytest.fixture(scope="session")
def image_registry(tmp_path_factory):
    """The container test bed (tests/e2e/imagebed.py): a local registry with user images."""
    from tests.e2e.imagebed import image_bed

    with image_bed(tmp_path_factory.mktemp("images")) as bed:
        yield bed


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


def free_port() -> int:
    """A port free on every address, below the kernel's ephemeral range, where no outgoing
    connection or bind to port 0 takes it before its server starts (scripts/testbed/free_port.py)."""
    return _FREE_PORT.free_port()


def wait_until_serving(url: str, seconds: float = 10.0) -> None:
    """Return once `url` answers HTTP; fail the test if it never does."""
    import time
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"{url} did not answer within {seconds:.0f} s")
            time.sleep(0.05)


def save_aws_block(server: S3Server, name: str, secret: str | None = None) -> str:
    """Save a prefect-aws AwsCredentials block for the test S3 server; return its name."""
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    AwsCredentials(
        aws_access_key_id=server.key_id,
        aws_secret_access_key=secret or server.secret,
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=server.endpoint),
    ).save(name, overwrite=True)
    return name


class S3Server:
    """A moto S3 server on loopback that checks credentials, with one user and one bucket."""

    def __init__(self, endpoint: str, key_id: str, secret: str, bucket: str) -> None:
        self.endpoint, self.key_id, self.secret, self.bucket = endpoint, key_id, secret, bucket

    def settings(self, secret: str | None = None):
        from pydantic import SecretStr

        from gpuflow.tasks.storage import S3Settings

        return S3Settings(
            endpoint_url=self.endpoint,
            region="us-east-1",
            access_key_id=self.key_id,
            secret_access_key=SecretStr(secret or self.secret),
        )

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])


@contextlib.contextmanager
def serve_s3(host: str, folder: Path) -> Iterator[S3Server]:
    """moto's server mode as a separate process on `host`, stopped by PID: one user (its
    credentials checked) and one bucket."""
    import json
    import shutil
    import signal
    import socket
    import subprocess

    import boto3

    binary = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which(
        "moto_server"
    )
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")  # the three IAM calls below
    log = folder / "moto.log"
    proc = subprocess.Popen(
        [binary, "-H", host, "-p", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        endpoint = f"http://{host}:{port}"
        wait_until_serving(f"{endpoint}/moto-api/")
        boot = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "boot",
            "aws_secret_access_key": "boot",
        }
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="gpuflow")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="gpuflow", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="gpuflow")["AccessKey"]
        server = S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], "gpuflow-test")
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=server.key_id,
            aws_secret_access_key=server.secret,
        ).create_bucket(Bucket=server.bucket)
        yield server
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """moto's server mode as a separate process on 127.0.0.1, stopped by PID."""
    with serve_s3("127.0.0.1", tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def aws_block(s3_server, prefect_api) -> str:
    """A prefect-aws AwsCredentials block pointing at the test S3 server."""
    return save_aws_block(s3_server, "gpuflow-test-s3")


@pytest.fixture(scope="session")
def mock_binary() -> str:
    """AWS's instance metadata mock, built by scripts/imds-mock.sh (cached)."""
    import subprocess

    done = subprocess.run(
        ["bash", str(Path(__file__).resolve().parents[1] / "scripts" / "imds-mock.sh"), "path"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def pushgateway(tmp_path):
    """A Prometheus Pushgateway on loopback, stopped by PID; yields its URL."""
    import shutil
    import signal
    import subprocess

    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus-pushgateway is not installed; scripts/test.sh installs it")
        pytest.skip("prometheus-pushgateway is not installed (scripts/test.sh installs it)")
    port = free_port()
    proc = subprocess.Popen(
        # Debian's build persists every group to one file in /var/lib by default: groups
        # from another test (or session) would come back; this one keeps them in memory.
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(f"{url}/-/ready")
    yield url
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


class PrometheusServer:
    def __init__(self, url: str, gateway: str) -> None:
        self.url, self.gateway = url, gateway

    def query(self, promql: str) -> list[dict]:
        import json
        import urllib.parse
        import urllib.request

        address = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(address, timeout=10) as answer:
            return json.load(answer)["data"]["result"]

    def query_names(self) -> list[str]:
        """Return the names of every metric Prometheus holds."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/v1/label/__name__/values", timeout=10) as a:
            return json.load(a)["data"]


@pytest.fixture
def prometheus(pushgateway, tmp_path) -> Iterator[PrometheusServer]:
    """A real Prometheus on loopback scraping the Pushgateway every second (honor_labels,
    as infra/prometheus says), with gpuflow's rules loaded; stopped by PID."""
    import shutil
    import signal
    import subprocess

    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed; scripts/test.sh installs it")
        pytest.skip("prometheus is not installed (scripts/test.sh installs it)")
    rules = Path(__file__).resolve().parents[1] / "infra" / "prometheus" / "gpuflow-rules.yml"
    config = tmp_path / "prometheus.yml"
    target = pushgateway.removeprefix("http://")
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{rules}]\n"
        "scrape_configs:\n"
        "  - job_name: pushgateway\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(f"{url}/-/ready", seconds=60)
        yield PrometheusServer(url, pushgateway)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
