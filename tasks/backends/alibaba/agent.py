"""gpuflow's agent on an ECS instance (gpuflow.tasks.backends.instances.agent) with what is
Alibaba Cloud's: the metadata service, OSS through its S3-compatible API and ECS's own
DeleteInstance, both with the instance RAM role's temporary credentials (no key on the
instance); the run's secret is an object of its mailbox.

    python -m gpuflow.tasks.backends.alibaba.agent --config <base64 JSON, no secrets in it>
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from gpuflow.tasks.backends.alibaba.metadata import ENDPOINT, EcsMetadata
from gpuflow.tasks.backends.alibaba.settings import EcsFleet, ecs_client, oss_client
from gpuflow.tasks.backends.instances import agent
from gpuflow.tasks.backends.instances.agent import AgentConfig

RENEW_BEFORE_S = 600  # the role's credentials are asked again this long before they expire


class AlibabaNode:
    """An ECS instance's cloud, reached with its RAM role's temporary credentials."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metadata = EcsMetadata(os.environ.get("GPUFLOW_ECS_METADATA_ENDPOINT", ENDPOINT))
        self.role = config.cloud.get("ram_role", "")
        self.lock = threading.Lock()
        self.keys: tuple[str, str, str | None] | None = None
        self.until = 0.0
        self.s3: Any = None

    def _keys(self) -> tuple[str, str, str | None]:
        with self.lock:
            if self.keys is None or time.monotonic() > self.until:
                found = self.metadata.role_credentials(self.role)
                self.keys = (
                    found["AccessKeyId"],
                    found["AccessKeySecret"],
                    found.get("SecurityToken"),
                )
                self.until = time.monotonic() + 3600 - RENEW_BEFORE_S
                self.s3 = None
            return self.keys

    def storage(self) -> Any:
        keys = self._keys()
        if self.s3 is None:
            region = self.config.cloud.get("oss_region") or self.config.region
            self.s3 = oss_client(self.config.endpoint_url or "", region, keys)
        return self.s3

    def read_secret(self, secret_id: str) -> str:
        bucket, _, key = secret_id.removeprefix("s3://").partition("/")
        body = self.storage().get_object(Bucket=bucket, Key=key)["Body"].read()
        return str(body.decode())

    def unit_env(self) -> dict[str, str]:
        key, secret, token = self._keys()
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": self.config.cloud.get("oss_region") or self.config.region,
        }
        if token:
            env["AWS_SESSION_TOKEN"] = token
        return env

    def terminate(self, instance_id: str) -> None:
        from alibabacloud_ecs20140526 import models

        fleet = EcsFleet(region=self.config.region)
        client = ecs_client(fleet, self._keys(), self.config.cloud.get("ecs_endpoint"))
        client.delete_instance(models.DeleteInstanceRequest(instance_id=instance_id, force=True))


def main(argv: list[str] | None = None) -> int:
    return agent.main(argv, "gpuflow.tasks.backends.alibaba.agent", AlibabaNode)


if __name__ == "__main__":
    sys.exit(main())
