"""The EC2 instance metadata service, as gpuflow's agent on an instance reads it: IMDSv2
only (a session token on every request), the instance's identity, and the notices that
end a spot instance: an interruption notice (two minutes' warning) and a rebalance
recommendation (risk of one soon).

The agent's `NoticeWatcher` (gpuflow.tasks.backends.instances.notices) polls both every
5 s: the agent sends the job SIGTERM at once, so a training saves its checkpoint and exits
75 well inside the warning.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import httpx

from gpuflow.tasks.backends.instances.notices import (
    MetadataUnavailable,
    Notice,
    NoticeWatcher,
    parse_time,
)

ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # IMDSv2's longest


class ImdsUnavailable(MetadataUnavailable):
    """The metadata service did not answer, or refused: one sentence with the cause."""


class Imds:
    """IMDSv2 requests to `endpoint` (the link-local address on an instance)."""

    def __init__(self, endpoint: str = ENDPOINT, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.http = httpx.Client(base_url=self.endpoint, timeout=timeout_s)
        self.token: str | None = None
        self.token_until = 0.0

    def close(self) -> None:
        self.http.close()

    def _token(self) -> str:
        if self.token is None or time.monotonic() > self.token_until:
            try:
                answer = self.http.put(
                    "/latest/api/token",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                )
            except httpx.HTTPError as exc:
                raise ImdsUnavailable(
                    f"the instance metadata service at {self.endpoint} did not answer"
                    f" ({type(exc).__name__}: {exc}); is this an EC2 instance with IMDS on?"
                ) from None
            if answer.status_code != 200:
                raise ImdsUnavailable(
                    f"the instance metadata service at {self.endpoint} gave no IMDSv2 token"
                    f" (HTTP {answer.status_code}); enable IMDSv2 (HttpTokens=required) on the"
                    " instance."
                )
            self.token = answer.text
            self.token_until = time.monotonic() + TOKEN_TTL_S - 60
        return self.token

    def get(self, path: str) -> str | None:
        """Return the text at `path`, None where the service has nothing (404)."""
        for attempt in (1, 2):
            try:
                answer = self.http.get(path, headers={"X-aws-ec2-metadata-token": self._token()})
            except httpx.HTTPError as exc:
                raise ImdsUnavailable(
                    f"the instance metadata service at {self.endpoint} did not answer {path}"
                    f" ({type(exc).__name__}: {exc})."
                ) from None
            if answer.status_code == 401 and attempt == 1:  # the token expired: a new one
                self.token = None
                continue
            if answer.status_code == 404:
                return None
            if answer.status_code != 200:
                raise ImdsUnavailable(
                    f"the instance metadata service answered {path} with HTTP {answer.status_code}."
                )
            return answer.text
        return None

    def instance_id(self) -> str:
        return self.get("/latest/meta-data/instance-id") or ""

    def address(self) -> str | None:
        return self.get("/latest/meta-data/local-ipv4")

    def identity(self) -> dict[str, object]:
        """Return the instance identity document (region, zone, type, account)."""
        return json.loads(self.get("/latest/dynamic/instance-identity/document") or "{}")

    def notices(self) -> list[Notice]:
        """Return the spot interruption notice and the rebalance recommendation there now."""
        now = datetime.now().astimezone()
        found = []
        action = self.get("/latest/meta-data/spot/instance-action")
        if action:
            body = json.loads(action)
            found.append(
                Notice(kind=f"spot-{body['action']}", at=parse_time(body["time"]), seen_at=now)
            )
        rebalance = self.get("/latest/meta-data/events/recommendations/rebalance")
        if rebalance:
            found.append(
                Notice(
                    kind="rebalance",
                    at=parse_time(json.loads(rebalance)["noticeTime"]),
                    seen_at=now,
                )
            )
        return found


__all__ = ["ENDPOINT", "Imds", "ImdsUnavailable", "Notice", "NoticeWatcher"]
