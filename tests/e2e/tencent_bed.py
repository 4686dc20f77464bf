"""Tencent Cloud CVM played on this machine: the fake CVM (tests/fakes/tencent_cvm.py) with
moto's S3 server standing in for COS's S3-compatible API, and its instances booted the way
CVM boots them (tests/e2e/alibaba_bed.PlayedEcs, pointed at CVM's metadata variable)."""

from __future__ import annotations

import sys
from typing import Any

from tests.e2e.alibaba_bed import objects_under
from tests.fakes.tencent_cvm import FakeCvm

CVM_FLEET = "gpuflow-test-cvm"
CVM_KEYS = "gpuflow-test-tencent"
PRICES = "gpuflow-test-cny"  # saved by alibaba_bed.save_blocks too: 0.14 USD per CNY
INSTALL = (
    'case "$GPUFLOW_WHEEL_GET" in *"/control-cvm/"*"/gpuflow/gpuflow-"*".whl?"*"Signature="*) ;;'
    ' *) echo "no presigned wheel URL: $GPUFLOW_WHEEL_GET"; exit 1;; esac'
    f" && GPUFLOW_PYTHON={sys.executable}"
)
METADATA = "GPUFLOW_CVM_METADATA_ENDPOINT"


def save_blocks(fake: FakeCvm, s3_server: Any, **settings: Any) -> None:
    from gpuflow.blocks import CvmGpuFleet, GpuPriceTable, TencentCredentials

    TencentCredentials(secret_id=fake.secret_id, secret_key=fake.secret_key).save(
        CVM_KEYS, overwrite=True
    )
    values: dict[str, Any] = {
        "region": "ap-guangzhou",
        "families": ["GN7", "GN10Xp"],
        "credentials": CVM_KEYS,
        "cam_role": "gpuflow-agent",
        "vpc_id": "vpc-test",
        "subnets": {"ap-guangzhou-3": "subnet-3", "ap-guangzhou-4": "subnet-4"},
        "security_group": "sg-test",
        "image_id": "img-test",
        "control_prefix": f"s3://{s3_server.bucket}/control-cvm",
        "endpoint": fake.endpoint,
        "cos_endpoint": s3_server.endpoint,
        "cos_region": "us-east-1",  # where moto keeps the bucket
        "install": INSTALL,
        "boot_timeout_s": 60,
    }
    CvmGpuFleet(**(values | settings)).save(CVM_FLEET, overwrite=True)
    GpuPriceTable(usd_per_unit={"CNY": 0.14}).save(PRICES, overwrite=True)


def cvm_spec(command: list[str], **sections: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": "cvm-test",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1, "gpu_product": "T4", "disk": "50Gi"},
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
        "placement": {
            "backend": "tencent",
            "block": CVM_FLEET,
            "market": "on-demand",
            "price_table": PRICES,
        },
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def left_on_cvm(fake: FakeCvm, s3_server: Any, run_id: str) -> list[str]:
    """What CVM and COS still hold of the run."""

    instances = [
        f"instance {i['InstanceId']}"
        for i in list(fake.instances.values())
        if i["Tags"].get("gpuflow.io/flow-run-id") == run_id
    ]
    return instances + objects_under(s3_server, f"control-cvm/{run_id}/")
