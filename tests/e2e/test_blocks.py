"""gpuflow's blocks against a real Prefect server: registered, created once, round-tripped,
used by a job spec; secrets stay out of the API's block document listing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuflow.tasks.errors import InvalidSpec
from tests.conftest import subprocess_env

pytestmark = pytest.mark.e2e


def test_blocks_init_creates_once_and_keeps_edits(prefect_api, gpuflow_home, capsys):
    from gpuflow.blocks import GpuPriceTable, LocalGpuHost
    from gpuflow.cli import main

    assert main(["blocks", "init"]) == 0
    first = capsys.readouterr().out
    assert "gpuflow-local-gpu-host/local" in first and "gpuflow-gpu-price-table/default" in first
    assert "gpuflow-ec2-gpu-fleet" in first  # the type, for the UI's block forms
    host = LocalGpuHost.load("local")
    host.gpu_hourly_usd = 2.5
    host.save("local", overwrite=True)  # an edit made after the first init
    assert main(["blocks", "init"]) == 0
    second = capsys.readouterr().out
    assert "created" not in second and second.count("kept") == 2
    assert LocalGpuHost.load("local").gpu_hourly_usd == 2.5
    assert GpuPriceTable.load("default").table().gpu_hourly("ec2", "NVIDIA-H200") == 13.86


def test_prefect_block_register_finds_the_module(prefect_api, gpuflow_home):
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
        env=subprocess_env(prefect_api, gpuflow_home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in (
        "gpuflow Local GPU Host",
        "gpuflow GPU Price Table",
        "gpuflow Kubernetes GPU Pool",
        "gpuflow EC2 GPU Fleet",
        "gpuflow Slurm Cluster",
    ):
        assert name in done.stdout


def test_kubernetes_pool_round_trips_with_its_cluster_config(prefect_api):
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from gpuflow.blocks import KubernetesGpuPool
    from gpuflow.tasks.platform.pool_template import check_job_variables, default_gpu_template

    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "lab", "cluster": {"server": "https://10.0.0.1:6443"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "kube-token-not-for-logs"}}],
        "current-context": "lab",
    }
    KubernetesClusterConfig(config=kubeconfig, context_name="lab").save("lab", overwrite=True)
    pool = KubernetesGpuPool(
        cluster_config=KubernetesClusterConfig.load("lab"),
        work_pool_name="gpu-k8s",
        gpu_count=4,
        gpu_product="NVIDIA-H100-80GB-HBM3",
        queue_name="team-gpu",
    )
    pool.save("h100", overwrite=True)
    loaded = KubernetesGpuPool.load("h100")
    assert loaded.cluster_config.context_name == "lab" and loaded.gpu_count == 4
    variables = check_job_variables(default_gpu_template(), loaded.job_variables())
    assert variables["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert variables["queue_name"] == "team-gpu"


def test_secrets_stay_out_of_the_block_document_listing(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect_aws import AwsCredentials

    from gpuflow.blocks import AlibabaCredentials, TencentCredentials

    secret = "wJalrXUtnFEMI-secret-for-the-listing-test"
    AwsCredentials(aws_access_key_id="AKIDLISTING", aws_secret_access_key=secret).save(
        "listing-test", overwrite=True
    )
    AlibabaCredentials(access_key_id="LTAILISTING", access_key_secret=secret + "-ram").save(
        "listing-test-aliyun", overwrite=True
    )
    TencentCredentials(secret_id="AKIDTCLISTING", secret_key=secret + "-cam").save(
        "listing-test-tencent", overwrite=True
    )
    with get_client(sync_client=True) as client:
        listing = client.read_block_documents(include_secrets=False)
    text = json.dumps([d.model_dump(mode="json") for d in listing])
    assert "listing-test" in text and "AKIDLISTING" in text
    assert "LTAILISTING" in text and "AKIDTCLISTING" in text
    assert secret not in text  # nor the RAM or CAM secret that starts with it
    assert AwsCredentials.load("listing-test").aws_secret_access_key.get_secret_value() == secret


def test_a_price_table_block_prices_the_run(prefect_api, gpuflow_home):
    from gpuflow.blocks import GpuPriceTable
    from gpuflow.tasks import placement
    from gpuflow.tasks.spec import load_spec

    GpuPriceTable(gpu_hourly_usd={"local": {"*": 3.0}}).save("lab-prices", overwrite=True)
    spec = load_spec(
        {
            "job": {"kind": "command", "command": ["true"]},
            "placement": {"price_table": "lab-prices"},
        }
    )
    _, prices = placement.resolve(spec)
    assert prices.gpu_hourly("local", "NVIDIA-A100-SXM4-80GB") == 3.0
    assert prices.gpu_hourly("ec2", "NVIDIA-H200") == 13.86  # defaults stay under it
    missing = load_spec(
        {"job": {"kind": "command", "command": ["true"]}, "placement": {"price_table": "nope"}}
    )
    with pytest.raises(InvalidSpec, match=r"placement\.price_table: there is no GpuPriceTable"):
        placement.resolve(missing)
