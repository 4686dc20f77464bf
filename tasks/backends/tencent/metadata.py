"""The CVM instance metadata service, as gpuflow's agent on an instance reads it: the
instance's id and private address, the spot instance's termination time (about two
minutes ahead) and the instance CAM role's temporary credentials."""

from __future__ import annotations

from gpuflow.tasks.backends.instances.notices import MetadataService

ENDPOINT = "http://metadata.tencentyun.com"


class CvmMetadata(MetadataService):
    name = "the CVM metadata service"
    spot_path = "/latest/meta-data/spot/termination-time"

    def instance_id(self) -> str:
        return self.get("/latest/meta-data/instance-id") or ""

    def address(self) -> str | None:
        return self.get("/latest/meta-data/local-ipv4")

    def role_credentials(self, role: str) -> dict[str, str]:
        """TmpSecretId, TmpSecretKey, Token, ExpiredTime of the instance's CAM role."""
        return self.role_json(
            f"/latest/meta-data/cam/security-credentials/{role}",
            role,
            "bind that CAM role to the instance (CvmGpuFleet cam_role).",
        )
