"""A run's mailbox in S3: how gpuflow and the agents on its instances talk (any S3-compatible store: S3, OSS, COS).

The agents pull (no inbound port, no SSH). Under `<control prefix>/<run id>/`:

    heartbeat                              the orchestrator's, rewritten every few seconds
    nodes/<instance>/ready                 the agent is up: address, GPUs, CPUs
    nodes/<instance>/units/<unit>/unit.json    what to run (no secrets: those are in
                                           Secrets Manager, named by the unit)
    nodes/<instance>/units/<unit>/stop     stop it: why, and the grace before SIGKILL
    nodes/<instance>/units/<unit>/log/<n>  its output lines, in order, a batch per object
    nodes/<instance>/units/<unit>/outputs/...  its output files, after it ended
    nodes/<instance>/units/<unit>/result.json  how it ended (written last)
    notices/<instance>                     a spot interruption notice the agent saw
    gone/<instance>                        the agent terminated its own instance, and why

Every object is small JSON or text; the keys alone say where a run stands.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

HEARTBEAT = "heartbeat"


class Mailbox:
    """One run's prefix in a bucket, read and written with a boto3 S3 client."""

    def __init__(self, s3: Any, url: str, run_id: str) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.s3, self.bucket = s3, bucket
        self.prefix = "/".join(p for p in (prefix.strip("/"), run_id) if p) + "/"
        self.url = f"s3://{bucket}/{self.prefix}"

    def put(self, key: str, data: bytes | str) -> None:
        body = data.encode() if isinstance(data, str) else data
        self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=body)

    def put_json(self, key: str, value: Any) -> None:
        self.put(key, json.dumps(value, sort_keys=True))

    def put_new(self, key: str, data: str) -> bool:
        """Write `key` only if no object is there (S3's conditional write); return whether
        this call made it."""
        from botocore.exceptions import ClientError

        try:
            self.s3.put_object(
                Bucket=self.bucket, Key=self.prefix + key, Body=data.encode(), IfNoneMatch="*"
            )
        except ClientError as exc:
            # S3's 412; OSS's and COS's own refusal (their forbid-overwrite header): 409
            refused = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if refused in (409, 412) or exc.response.get("Error", {}).get("Code") in EXISTS:
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def get(self, key: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def get_json(self, key: str) -> Any:
        data = self.get(key)
        return None if data is None else json.loads(data)

    def keys(self, under: str = "", after: str = "") -> list[str]:
        """Return the keys under `under` (relative to the run's prefix), in order, those
        after `after` only when given."""
        found: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + under}
        if after:
            kwargs["StartAfter"] = self.prefix + after
        for page in self.s3.get_paginator("list_objects_v2").paginate(**kwargs):
            found += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return found

    def delete_all(self) -> int:
        """Delete everything the run's prefix holds; return how many objects went."""
        keys = self.keys()
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(keys)


def unit_key(instance: str, unit: str, leaf: str = "") -> str:
    return f"nodes/{instance}/units/{unit}/{leaf}"


def log_key(instance: str, unit: str, seq: int) -> str:
    return unit_key(instance, unit, f"log/{seq:08d}")


def s3_compatible(
    url: str, region: str, keys: tuple[str, str, str | None], forbid_overwrite: str = ""
) -> Any:
    """A boto3 client of an S3-compatible object store at `url` (OSS, COS) signing for
    `region`: virtual-hosted addressing, as they require, except on an address or
    localhost. `forbid_overwrite`: the store's own header that refuses to overwrite an
    object (x-oss-forbid-overwrite, x-cos-forbid-overwrite), sent with every conditional
    write (`If-None-Match: *`) too, where the store may not honour S3's."""
    import boto3
    from botocore.config import Config

    key, secret, token = keys
    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name=region,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        aws_session_token=token or None,
        config=Config(
            s3={"addressing_style": addressing_style(url)},
            retries={"max_attempts": 5, "mode": "standard"},
        ),
    )
    if forbid_overwrite:

        def also_forbid(request: Any, **_: Any) -> None:
            if request.headers.get("If-None-Match") == "*":
                request.headers[forbid_overwrite] = "true"

        client.meta.events.register("before-sign.s3.PutObject", also_forbid)
    return client


EXISTS = ("PreconditionFailed", "412", "FileAlreadyExists", "ObjectAlreadyExists")


def addressing_style(url: str) -> str:
    """How buckets are addressed at `url`: by path on an address or localhost, else
    virtual-hosted (as OSS and COS require)."""
    host = urlsplit(url).hostname or ""
    return "path" if host == "localhost" or _is_address(host) else "virtual"


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
