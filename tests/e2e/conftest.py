"""Fixtures the end-to-end tests share: the Kubernetes test cluster (one per session) and
an EC2 fleet on moto whose instances are booted here, and a GPU fleet of namespaced hosts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, load_config
from tests.conftest import save_aws_block
from tests.e2e.alibaba_bed import PlayedEcs, save_blocks
from tests.e2e.instances import PlayedInstances
from tests.e2e.tencent_bed import METADATA as CVM_METADATA
from tests.e2e.tencent_bed import save_blocks as save_cvm_blocks
from tests.fakes.alibaba_ecs import FakeEcs
from tests.fakes.tencent_cvm import FakeCvm

ROOT = Path(__file__).resolve().parents[2]
FLEET = "gpuflow-test-fleet"


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """The test cluster, up for the whole session, stopped by PID at its end."""
    folder = tmp_path_factory.mktemp("k8s-testbed")
    script = ROOT / "scripts" / "k8s-testbed.sh"
    subprocess.run(["bash", str(script), "up", "--dir", str(folder)], check=True, timeout=900)
    yield folder / "kubeconfig"
    subprocess.run(["bash", str(script), "down", "--dir", str(folder)], check=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_testbed(tmp_path_factory):
    """The Slurm test cluster (scripts/slurm-testbed.sh), up for the whole session: its
    slurm.conf, for SLURM_CONF."""
    if os.geteuid() != 0:  # slurmd starts each job step as its user
        pytest.skip("the Slurm test cluster needs root (the test command runs as root in CI)")
    folder = tmp_path_factory.mktemp("slurm-testbed")
    script = ROOT / "scripts" / "slurm-testbed.sh"
    subprocess.run(["bash", str(script), "up", "--dir", str(folder)], check=True, timeout=300)
    yield folder / "slurm.conf"
    subprocess.run(["bash", str(script), "down", "--dir", str(folder)], check=True, timeout=120)


@pytest.fixture
def slurm(slurm_testbed, monkeypatch) -> Path:
    monkeypatch.setenv("SLURM_CONF", str(slurm_testbed))
    return slurm_testbed


@pytest.fixture
def kube(testbed, monkeypatch) -> KubeApi:
    monkeypatch.setenv("KUBECONFIG", str(testbed))
    return KubeApi(load_config())


def clients(s3_server) -> dict:
    params = {
        "endpoint_url": s3_server.endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": s3_server.key_id,
        "aws_secret_access_key": s3_server.secret,
    }
    return {name: boto3.client(name, **params) for name in ("ec2", "s3", "secretsmanager")}


@pytest.fixture
def aws(s3_server, prefect_api, gpuflow_home, monkeypatch) -> dict:
    """An Ec2GpuFleet block for moto (the local build as the install step) and clients."""
    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet

    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    found = clients(s3_server)
    image = found["ec2"].describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    Ec2GpuFleet(
        region="us-east-1",
        families=["g6"],
        aws_credentials=save_aws_block(s3_server, "gpuflow-test-aws"),
        image_id=image,
        control_prefix=f"s3://{s3_server.bucket}/control",
        install=f"GPUFLOW_PYTHON={sys.executable}  # the local build",
        boot_timeout_s=60,
    ).save(FLEET, overwrite=True)
    return found


@pytest.fixture
def played(aws, s3_server, mock_binary, tmp_path):
    profile = {
        "AWS_ACCESS_KEY_ID": s3_server.key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with PlayedInstances(aws["ec2"], mock_binary, tmp_path / "instances", profile) as instances:
        yield instances


@pytest.fixture
def s3_scene(s3_server, tmp_path, monkeypatch) -> str:
    """The demo scene (a moving cube, 8 frames) in moto's S3; this process (and so the
    units elsewhere: pods through the run's Secret, Slurm steps through srun's
    environment) has the bucket's credentials as AWS_* variables."""
    import shutil as sh

    from gpuflow.tasks.render.scene import demo_scene
    from gpuflow.tasks.storage import store_for

    blender = sh.which("blender")
    assert blender, "blender is not installed; the test command installs it"
    blend = demo_scene(blender, tmp_path / "cube.blend", 8, 32, None)
    url = s3_server.url("k8s-scenes/cube.blend")
    store_for(url, s3_server.settings()).upload_file(url, blend)
    for key, value in s3_server.settings().child_env().items():
        monkeypatch.setenv(key, value)
    return url


@pytest.fixture(scope="session")
def contract_fleet(tmp_path_factory, prefect_api) -> Iterator[dict]:
    """A one-host fleet (2 GPUs) for the backend contract, applied as GpuFleet `contract`
    (a lease of 10 s: a killed orchestrator's run looks orphaned soon)."""
    from tests.e2e.fleet_bed import fleet_bed, host_entry, save_fleet

    with fleet_bed(tmp_path_factory.mktemp("contract-fleet") / "bed", ["c1:2"]) as bed:
        save_fleet(bed, "contract", [host_entry(bed, "c1")], lease_s=10)
        home = tmp_path_factory.mktemp("contract-fleet-home")
        done = subprocess.run(
            [sys.executable, "-m", "gpuflow", "fleet", "apply", "contract"],
            env={**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield bed


@pytest.fixture
def ecs(s3_server, prefect_api, gpuflow_home, monkeypatch) -> Iterator[FakeEcs]:
    """The fake ECS (the account's keys are the S3 server's: OSS and ECS take the same
    AccessKey) and the test's blocks."""
    for name in ("ALIBABA_CLOUD_ACCESS_KEY_ID", "ALIBABA_CLOUD_ACCESS_KEY_SECRET"):
        monkeypatch.delenv(name, raising=False)
    with FakeEcs(s3_server.key_id, s3_server.secret) as fake:
        save_blocks(fake, s3_server)
        yield fake


@pytest.fixture
def played_ecs(ecs, tmp_path) -> Iterator[PlayedEcs]:
    with PlayedEcs(ecs, tmp_path / "instances") as played:
        yield played


@pytest.fixture
def cvm(s3_server, prefect_api, gpuflow_home, monkeypatch) -> Iterator[FakeCvm]:
    """The fake CVM (the account's keys are the S3 server's: COS and CVM take the same
    key) and the test's blocks."""
    for name in ("TENCENTCLOUD_SECRET_ID", "TENCENTCLOUD_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    with FakeCvm(s3_server.key_id, s3_server.secret) as fake:
        save_cvm_blocks(fake, s3_server)
        yield fake


@pytest.fixture
def played_cvm(cvm, tmp_path) -> Iterator[PlayedEcs]:
    with PlayedEcs(cvm, tmp_path / "cvm-instances", CVM_METADATA) as played:
        yield played
