"""The EC2 instance metadata service, as gpuflow's agent on an instance reads it: IMDSv2
only (a session token on every request), the instance's identity, and the notices that
end a spot instance: an interruption notice (two minutes' warning) and a rebalance
recommendation (risk of one soon).

`NoticeWatcher` polls both every `every_s` seconds (5 by default) in a thread of its own
and calls `on_notice` once per notice, at once: the agent sends the job SIGTERM, so a
training saves its checkpoint and exits 75 well inside the warning.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime

import httpx
from pydantic import BaseModel

ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # IMDSv2's longest
NOTICE_EVERY_S = 5.0


class ImdsUnavailable(Exception):
    """The metadata service did not answer, or refused: one sentence with the cause."""


class Notice(BaseModel):
    kind: str  # "spot-terminate" | "spot-stop" | "spot-hibernate" | "rebalance"
    at: datetime  # when the action happens (spot) or the recommendation was made
    seen_at: datetime


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
            found.append(Notice(kind=f"spot-{body['action']}", at=_time(body["time"]), seen_at=now))
        rebalance = self.get("/latest/meta-data/events/recommendations/rebalance")
        if rebalance:
            found.append(
                Notice(kind="rebalance", at=_time(json.loads(rebalance)["noticeTime"]), seen_at=now)
            )
        return found


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class NoticeWatcher:
    """Polls the metadata service for notices in a thread; `on_notice` is called once per
    kind of notice, as soon as a poll sees it (an instance gets one interruption; a
    rebalance recommendation's time may be given anew on each read). `on_trouble` hears, once, that the
    service stopped answering (the watch goes on)."""

    def __init__(
        self,
        imds: Imds,
        on_notice: Callable[[Notice], None],
        every_s: float = NOTICE_EVERY_S,
        on_trouble: Callable[[str], None] | None = None,
    ) -> None:
        self.imds, self.on_notice, self.every_s = imds, on_notice, every_s
        self.on_trouble = on_trouble
        self.seen: set[str] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="gpuflow-notices")

    def __enter__(self) -> NoticeWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.every_s + 5)

    def _watch(self) -> None:
        troubled = False
        while not self.stopping.is_set():
            try:
                for notice in self.imds.notices():
                    if notice.kind not in self.seen:
                        self.seen.add(notice.kind)
                        self.on_notice(notice)
                troubled = False
            except ImdsUnavailable as exc:
                if not troubled and self.on_trouble is not None:
                    self.on_trouble(str(exc))
                troubled = True
            self.stopping.wait(self.every_s)
