"""gpuflow's agent on a CVM instance (gpuflow.tasks.backends.instances.agent) with what is
Tencent Cloud's: the metadata service, COS through its S3-compatible API and CVM's own
TerminateInstances, both with the instance CAM role's temporary credentials (no key on the
instance); the run's secret is an object of its mailbox.

    python -m gpuflow.tasks.backends.tencent.agent --config <base64 JSON, no secrets in it>
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from gpuflow.tasks.backends.instances import agent
from gpuflow.tasks.backends.instances.agent import AgentConfig
from gpuflow.tasks.backends.instances.mailbox import s3_compatible
from gpuflow.tasks.backends.tencent.metadata import ENDPOINT, CvmMetadata
from gpuflow.tasks.backends.tencent.settings import CvmFleet, cvm_client

RENEW_BEFORE_S = 600


class TencentNode:
    """A CVM instance's cloud, reached with its CAM role's temporary credentials."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metadata = CvmMetadata(os.environ.get("GPUFLOW_CVM_METADATA_ENDPOINT", ENDPOINT))
        self.role = config.cloud.get("cam_role", "")
        self.lock = threading.Lock()
        self.keys: tuple[str, str, str | None] | None = None
        self.until = 0.0
        self.s3: Any = None

    def _keys(self) -> tuple[str, str, str | None]:
        with self.lock:
            if self.keys is None or time.monotonic() > self.until:
                found = self.metadata.role_credentials(self.role)
                self.keys = (found["TmpSecretId"], found["TmpSecretKey"], found.get("Token"))
                self.until = time.monotonic() + 3600 - RENEW_BEFORE_S
                self.s3 = None
            return self.keys

    def _region(self) -> str:
        return self.config.cloud.get("cos_region") or self.config.region

    def storage(self) -> Any:
        keys = self._keys()
        if self.s3 is None:
            self.s3 = s3_compatible(self.config.endpoint_url or "", self._region(), keys)
        return self.s3

    def read_secret(self, secret_id: str) -> str:
        bucket, _, key = secret_id.removeprefix("s3://").partition("/")
        return str(self.storage().get_object(Bucket=bucket, Key=key)["Body"].read().decode())

    def unit_env(self) -> dict[str, str]:
        key, secret, token = self._keys()
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": self._region(),
        }
        if token:
            env["AWS_SESSION_TOKEN"] = token
        return env

    def terminate(self, instance_id: str) -> None:
        from tencentcloud.cvm.v20170312 import models

        fleet = CvmFleet(region=self.config.region)
        endpoint = self.config.cloud.get("cvm_endpoint") or None
        request = models.TerminateInstancesRequest()
        request.InstanceIds = [instance_id]
        cvm_client(fleet, self._keys(), endpoint).TerminateInstances(request)


def main(argv: list[str] | None = None) -> int:
    return agent.main(argv, "gpuflow.tasks.backends.tencent.agent", TencentNode)


if __name__ == "__main__":
    sys.exit(main())
