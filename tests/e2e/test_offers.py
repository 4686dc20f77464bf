"""`gpuflow offers`: EC2's GPU types, zones and spot prices read from moto's EC2 (server
mode on loopback, credentials checked), ranked for a job; bad input is one sentence and
nothing is launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import save_aws_block, subprocess_env

pytestmark = pytest.mark.e2e
GPUFLOW = [sys.executable, "-m", "gpuflow"]


def job(tmp_path: Path, **sections) -> Path:
    spec = {
        "name": "offers-test",
        "job": {"kind": "command", "command": ["nvidia-smi"]},
        "resources": {"gpus": 1, "gpu_product": "L4", "disk": "100Gi"},
        "limits": {"max_duration": "2h"},
        "placement": {"backend": "ec2"},
    }
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def offers(
    s3_server, tmp_path: Path, spec: Path, *args: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`gpuflow offers` with the standard AWS_* variables pointing at moto."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_"))} | {
        "GPUFLOW_HOME": str(tmp_path / "home"),
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    base |= {"AWS_ENDPOINT_URL": s3_server.endpoint} | s3_server.settings().child_env()
    return subprocess.run(
        [*GPUFLOW, "offers", str(spec), *args],
        env=base | (env or {}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def instances(s3_server) -> list[str]:
    """Every instance moto holds (other tests' terminated ones included)."""
    import boto3

    ec2 = boto3.client(
        "ec2",
        endpoint_url=s3_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_server.key_id,
        aws_secret_access_key=s3_server.secret,
    )
    return [
        i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
    ]


def test_offers_rank_spot_before_on_demand_cheapest_and_smallest_first(s3_server, tmp_path):
    before = instances(s3_server)
    done = offers(s3_server, tmp_path, job(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert {o["product"] for o in found} == {"NVIDIA-L4"}
    markets = [o["market"] for o in found]
    assert markets == sorted(markets, key=lambda m: m != "spot") and set(markets) == {
        "spot",
        "on-demand",
    }
    spot = [o for o in found if o["market"] == "spot"]
    assert spot[0]["instance_type"] == "g6.xlarge"  # at one price, the smallest that fits
    assert [o["hourly_usd"] for o in spot] == sorted(o["hourly_usd"] for o in spot)
    disk_hourly = 100 * 0.08 / 730  # 100 GiB of gp3 at the table's GB-month price
    on_demand = [o for o in found if o["market"] == "on-demand"]
    assert on_demand[0]["hourly_usd"] == pytest.approx(0.805 + disk_hourly, abs=1e-6)
    assert on_demand[0]["job_usd"] == pytest.approx((0.805 + disk_hourly) * 2, abs=0.01)
    assert {o["zone"] for o in found} <= {f"us-east-1{z}" for z in "abcdef"}
    assert instances(s3_server) == before  # nothing launched
    table = offers(s3_server, tmp_path, job(tmp_path), "--top", "3")
    assert table.returncode == 0, table.stderr
    assert "g6.xlarge" in table.stdout.splitlines()[2]
    assert f"... {len(found) - 3} more" in table.stdout


@pytest.mark.parametrize("market", ["spot", "on-demand"])
def test_the_market_setting_keeps_only_its_offers(s3_server, tmp_path, market):
    done = offers(s3_server, tmp_path, job(tmp_path, placement={"market": market}), "--json")
    assert done.returncode == 0, done.stderr
    assert {o["market"] for o in json.loads(done.stdout)} == {market}


def test_a_fleet_block_limits_zones_and_families_with_its_own_credentials(
    s3_server, prefect_api, tmp_path, gpuflow_home
):
    """The Ec2GpuFleet block says where; its AwsCredentials block says who (no AWS_*
    variables at all)."""
    from gpuflow.blocks import Ec2GpuFleet

    save_aws_block(s3_server, "offers-aws")
    Ec2GpuFleet(
        region="us-east-1",
        zones=["us-east-1b"],
        families=["g6", "g5"],
        aws_credentials="offers-aws",
    ).save("offers-fleet", overwrite=True)
    spec = job(
        tmp_path,
        resources={"gpu_product": None, "gpus": 4},
        placement={"block": "offers-fleet", "market": "on-demand"},
    )
    env = {
        k: v
        for k, v in subprocess_env(prefect_api, gpuflow_home).items()
        if not k.startswith("AWS_")
    }
    done = subprocess.run(
        [*GPUFLOW, "offers", str(spec), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert {o["zone"] for o in found} == {"us-east-1b"}
    assert {o["instance_type"].split(".")[0] for o in found} <= {"g6", "g5"}
    assert all(o["gpus"] >= 4 for o in found)
    # 4 x A10G (1.006 each) costs more than 4 x L4 (0.805 each): L4 first
    assert found[0]["product"] == "NVIDIA-L4" and found[0]["gpus"] == 4


@pytest.mark.parametrize(
    ("sections", "env", "expected"),
    [
        (
            {},
            {"AWS_DEFAULT_REGION": "us-nowhere-1"},
            "region (no Ec2GpuFleet in placement.block: AWS_* variables and defaults):"
            " 'us-nowhere-1' is not an AWS region",
        ),
        (
            {"resources": {"gpu_product": "RTX4090"}},
            {},
            "resources.gpu_product: no EC2 instance type in us-east-1 has NVIDIA-GeForce-RTX-4090;",
        ),
        (
            {"resources": {"gpu_product": "H100", "gpus": 16}},
            {},
            "resources.gpus: the largest NVIDIA-H100-80GB-HBM3 type in us-east-1 has 8 GPUs;",
        ),
        (
            {
                "resources": {"gpu_product": "H100"},
                "limits": {"max_cost_usd": 5},
                "placement": {"market": "on-demand"},
            },
            {},
            "limits.max_cost_usd: $5 buys less than one hour of the cheapest fitting offer"
            " (p5.4xlarge (1 x NVIDIA-H100-80GB-HBM3) on-demand in",
        ),
        (
            {"resources": {"gpus": 0, "gpu_product": None}},
            {},
            "resources.gpus: the ec2 backend rents GPU instances; ask for at least 1 GPU",
        ),
        (
            {},
            {"AWS_SECRET_ACCESS_KEY": "not-the-secret-7d1f"},
            "EC2 in us-east-1 refused the credentials from the AWS_* variables (",
        ),
    ],
    ids=["unknown-region", "no-type-has-product", "too-many-gpus", "budget", "no-gpus", "refused"],
)
def test_bad_input_is_one_sentence_and_nothing_is_launched(
    s3_server, tmp_path, sections, env, expected
):
    before = instances(s3_server)
    done = offers(s3_server, tmp_path, job(tmp_path, **sections), env=env)
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith(f"gpuflow: invalid input: {expected}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "not-the-secret-7d1f" not in done.stderr and s3_server.secret not in done.stderr
    assert instances(s3_server) == before


def test_a_job_on_ec2_without_a_fleet_block_is_refused_in_one_sentence(tmp_path):
    done = subprocess.run(
        [*GPUFLOW, "run", str(job(tmp_path))],
        env={**os.environ, "GPUFLOW_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "gpuflow: invalid input: placement.block: launching on ec2 needs an Ec2GpuFleet block"
        " (its image_id and control_prefix); create one with blocks.Ec2GpuFleet(...).save(name)"
        " and name it here (gpuflow offers ranks without one)."
    )
