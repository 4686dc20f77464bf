"""gpuflow's agent on a CVM instance (gpuflow.tasks.backends.instances.agent) with what is
Tencent Cloud's: the metadata service, COS through its S3-compatible API and CVM's own
TerminateInstances, both with the instance CAM role's temporary credentials (no key on the
instance); the run's secret is an object of its mailbox.

    python -m gpuflow.tasks.backends.tencent.agent --config <base64 JSON, no secrets in it>
"""

from __future__ import annotations

import os
import sys

from gpuflow.tasks.backends.instances import agent
from gpuflow.tasks.backends.instances.agent import AgentConfig, RoleNode
from gpuflow.tasks.backends.tencent.metadata import ENDPOINT, CvmMetadata
from gpuflow.tasks.backends.tencent.settings import CvmFleet, cvm_client


class TencentNode(RoleNode):
    """A CVM instance's cloud, reached with its CAM role's temporary credentials."""

    metadata: CvmMetadata

    def __init__(self, config: AgentConfig) -> None:
        endpoint = os.environ.get("GPUFLOW_CVM_METADATA_ENDPOINT", ENDPOINT)
        super().__init__(config, CvmMetadata(endpoint))

    def role_keys(self) -> tuple[str, str, str | None]:
        found = self.metadata.role_credentials(self.config.cloud.get("cam_role", ""))
        return found["TmpSecretId"], found["TmpSecretKey"], found.get("Token") or None

    def terminate(self, instance_id: str) -> None:
        from tencentcloud.cvm.v20170312 import models

        fleet = CvmFleet(region=self.config.region)
        endpoint = self.config.cloud.get("cvm_endpoint") or None
        request = models.TerminateInstancesRequest()
        request.InstanceIds = [instance_id]
        cvm_client(fleet, self.current_keys(), endpoint).TerminateInstances(request)


def main(argv: list[str] | None = None) -> int:
    return agent.main(argv, "gpuflow.tasks.backends.tencent.agent", TencentNode)


if __name__ == "__main__":
    sys.exit(main())
