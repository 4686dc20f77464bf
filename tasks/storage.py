"""One small interface over file:// and s3:// URLs: atomic writes, checksums, listing,
streaming reads. S3 settings come from a prefect-aws AwsCredentials block or the
environment (AWS_* variables), so S3-compatible servers work through endpoint_url.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from pydantic import BaseModel, SecretStr

from gpuflow.tasks import extras
from gpuflow.tasks.errors import GpuflowError, InvalidSpec, TransientError
from gpuflow.tasks.saved_blocks import load_block

CHUNK = 8 * 2**20


class StorageError(GpuflowError):
    """A storage URL could not be read or written for a reason the user must fix."""


class ObjectMissing(StorageError):
    """The URL names nothing: no such object or file."""


class ObjectInfo(BaseModel):
    url: str
    size: int
    sha256: str | None = None


class S3Settings(BaseModel):
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    # the block's aws_client_parameters.config (botocore's Config: retries, timeouts)
    client_config: dict[str, Any] = {}

    @classmethod
    def from_env(cls) -> S3Settings:
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
        token = os.environ.get("AWS_SESSION_TOKEN")
        return cls(
            endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL"),
            region=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"),
            access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=SecretStr(secret) if secret else None,
            session_token=SecretStr(token) if token else None,
        )

    @classmethod
    def from_block(cls, name: str) -> S3Settings:
        """Return settings from the prefect-aws AwsCredentials block `name`."""
        extras.require("aws", "storage.aws_credentials", "an AwsCredentials block")
        from prefect_aws import AwsCredentials

        block = load_block(
            AwsCredentials,
            name,
            "storage.aws_credentials",
            create=f"prefect-aws (AwsCredentials(...).save({name!r}))",
            error=StorageError,
        )
        params = block.aws_client_parameters
        return cls(
            endpoint_url=params.endpoint_url if params else None,
            region=block.region_name,
            access_key_id=block.aws_access_key_id,
            secret_access_key=block.aws_secret_access_key,
            session_token=block.aws_session_token,
            client_config=dict(params.config or {}) if params else {},
        )

    def child_env(self) -> dict[str, str]:
        """Return the AWS_* variables that give a child process the same access."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value()
            if self.secret_access_key
            else None,
            "AWS_SESSION_TOKEN": self.session_token.get_secret_value()
            if self.session_token
            else None,
        }
        return {k: v for k, v in env.items() if v}

    def client_kwargs(self) -> dict[str, str]:
        """Return the endpoint and keys as boto3.client's keyword arguments (those set)."""
        kwargs = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key.get_secret_value()
            if self.secret_access_key
            else None,
            "aws_session_token": self.session_token.get_secret_value()
            if self.session_token
            else None,
        }
        return {k: v for k, v in kwargs.items() if v}

    def secrets(self) -> list[str]:
        return [s.get_secret_value() for s in (self.secret_access_key, self.session_token) if s]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def join(prefix: str, *parts: str) -> str:
    """Return `prefix`/`parts...` for any scheme."""
    return "/".join([prefix.rstrip("/"), *(p.strip("/") for p in parts)])


class FileStore:
    """file:///absolute/path URLs. Writes go to a temporary file, then rename."""

    @staticmethod
    def _path(url: str) -> Path:
        return Path(urlparse(url).path)

    def exists(self, url: str) -> bool:
        return self._path(url).is_file()

    def read_head(self, url: str, size: int) -> bytes:
        with self.open(url) as handle:
            return handle.read(size)

    def read_bytes(self, url: str) -> bytes:
        try:
            return self._path(url).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{url} does not exist; check the URL.") from None

    def open(self, url: str) -> IO[bytes]:
        try:
            return open(self._path(url), "rb")
        except FileNotFoundError:
            raise ObjectMissing(f"{url} does not exist; check the URL.") from None

    def write_bytes(self, url: str, data: bytes) -> ObjectInfo:
        target = self._path(url)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        return self._publish(url, tmp)

    def upload_file(self, url: str, path: Path, move: bool = False) -> ObjectInfo:
        target = self._path(url)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        (shutil.move if move else shutil.copyfile)(path, tmp)
        return self._publish(url, tmp)

    def _publish(self, url: str, tmp: Path) -> ObjectInfo:
        """Rename the finished temporary sibling `tmp` onto the object: readers see the old
        object or the whole new one, never a part."""
        target = self._path(url)
        digest = sha256_file(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
        return ObjectInfo(url=url, size=target.stat().st_size, sha256=digest)

    def download_file(self, url: str, path: Path) -> None:
        try:
            shutil.copyfile(self._path(url), path)
        except FileNotFoundError:
            raise ObjectMissing(f"{url} does not exist; check the URL.") from None

    def list(self, prefix: str) -> list[ObjectInfo]:
        root = self._path(prefix)
        if not root.is_dir():
            return []
        found = []
        for path in sorted(root.rglob("*")):
            if ".tmp-" in path.name:
                _sweep_if_dead(path)
            elif path.is_file():
                found.append(ObjectInfo(url=f"file://{path}", size=path.stat().st_size))
        return found

    def checksum(self, url: str) -> str | None:
        path = self._path(url)
        return sha256_file(path) if path.is_file() else None

    def delete(self, url: str) -> None:
        self._path(url).unlink(missing_ok=True)


def _sweep_if_dead(path: Path) -> None:
    """Remove a temporary file (`.NAME.tmp-PID`) whose writer died before its rename."""
    import psutil

    pid = path.name.rsplit(".tmp-", 1)[-1]
    if not pid.isdigit() or not psutil.pid_exists(int(pid)):
        path.unlink(missing_ok=True)


class S3Store:
    """s3://bucket/key URLs through boto3. A PUT is atomic per object; the sha256 of each
    object is kept in its metadata, so a rerun can tell identical content."""

    def __init__(self, settings: S3Settings | None = None) -> None:
        extras.require("aws", "storage", "an s3:// URL")
        import boto3
        from botocore.config import Config

        self.settings = settings or S3Settings.from_env()
        s = self.settings
        self.client = boto3.client(
            "s3",
            region_name=s.region or "us-east-1",
            **s.client_kwargs(),
            config=Config(
                retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60
            ),
        )

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        parsed = urlparse(url)
        return parsed.netloc, parsed.path.lstrip("/")

    def _call(self, url: str, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
            ParamValidationError,
        )

        try:
            return getattr(self.client, method)(**kwargs)
        except ClientError as exc:
            raise _explain(url, exc) from None
        except NoCredentialsError:
            raise StorageError(
                f"no AWS credentials were found for {url}; name an AwsCredentials block"
                " (storage.aws_credentials / --aws-credentials) or set AWS_ACCESS_KEY_ID and"
                " AWS_SECRET_ACCESS_KEY."
            ) from None
        except ParamValidationError:
            raise StorageError(
                f"{url!r} is not a valid S3 URL; write s3://bucket/prefix."
            ) from None
        except EndpointConnectionError:
            raise TransientError(
                f"could not reach the S3 server for {url}; is it running?"
            ) from None
        except BotoCoreError as exc:
            raise TransientError(f"S3 request for {url} failed: {type(exc).__name__}") from None

    def exists(self, url: str) -> bool:
        bucket, key = self._split(url)
        try:
            self._call(url, "head_object", Bucket=bucket, Key=key)
            return True
        except ObjectMissing:
            return False

    def read_bytes(self, url: str) -> bytes:
        with self.open(url) as body:
            return body.read()

    def read_head(self, url: str, size: int) -> bytes:
        bucket, key = self._split(url)
        response = self._call(
            url, "get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{size - 1}"
        )
        return response["Body"].read()

    def open(self, url: str) -> IO[bytes]:
        bucket, key = self._split(url)
        return self._call(url, "get_object", Bucket=bucket, Key=key)["Body"]

    def write_bytes(self, url: str, data: bytes) -> ObjectInfo:
        bucket, key = self._split(url)
        digest = hashlib.sha256(data).hexdigest()
        self._call(
            url, "put_object", Bucket=bucket, Key=key, Body=data, Metadata={"sha256": digest}
        )
        return ObjectInfo(url=url, size=len(data), sha256=digest)

    def upload_file(self, url: str, path: Path, move: bool = False) -> ObjectInfo:
        digest = sha256_file(path)
        bucket, key = self._split(url)
        size = path.stat().st_size
        with open(path, "rb") as handle:
            self._call(
                url, "put_object", Bucket=bucket, Key=key, Body=handle, Metadata={"sha256": digest}
            )
        if move:
            path.unlink()
        return ObjectInfo(url=url, size=size, sha256=digest)

    def download_file(self, url: str, path: Path) -> None:
        with self.open(url) as body, open(path, "wb") as out:
            shutil.copyfileobj(body, out, CHUNK)

    def list(self, prefix: str) -> list[ObjectInfo]:
        bucket, key = self._split(prefix)
        key = key.rstrip("/") + "/" if key else ""
        found: list[ObjectInfo] = []
        token: dict[str, str] = {}
        while True:
            page = self._call(prefix, "list_objects_v2", Bucket=bucket, Prefix=key, **token)
            found += [
                ObjectInfo(url=f"s3://{bucket}/{o['Key']}", size=o["Size"])
                for o in page.get("Contents", [])
            ]
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def checksum(self, url: str) -> str | None:
        bucket, key = self._split(url)
        try:
            head = self._call(url, "head_object", Bucket=bucket, Key=key)
        except ObjectMissing:
            return None
        return head.get("Metadata", {}).get("sha256")

    def delete(self, url: str) -> None:
        bucket, key = self._split(url)
        self._call(url, "delete_object", Bucket=bucket, Key=key)


def _explain(url: str, exc: Any) -> GpuflowError:
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchKey", "404", "NotFound"):
        return ObjectMissing(f"{url} does not exist; check the URL.")
    if code == "NoSuchBucket":
        return StorageError(f"the bucket of {url} does not exist; create it or fix the URL.")
    if (
        code
        in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken")
        or status == 403
    ):
        return StorageError(
            f"the S3 server refused the credentials for {url} ({code or status});"
            " check the AwsCredentials block or AWS_* variables."
        )
    if status and status >= 500:
        return TransientError(
            f"the S3 server failed on {url} ({code or status}); retrying may help."
        )
    return StorageError(f"S3 refused {url}: {code or status}.")


def local_paths(*urls: str | None) -> list[str]:
    """The paths on this machine of the `file://` URLs among `urls` (what a unit in an
    image has mounted to read or write them)."""
    return [urlparse(url).path for url in urls if url and urlparse(url).scheme == "file"]


def store_for(url: str, s3: S3Settings | None = None) -> FileStore | S3Store:
    """Return the store for `url`'s scheme."""
    scheme = urlparse(url).scheme
    if scheme == "file":
        return FileStore()
    if scheme == "s3":
        if not urlparse(url).netloc:
            raise StorageError(f"{url!r} names no bucket; write s3://bucket/prefix.")
        return S3Store(s3)
    raise StorageError(f"{url!r} is not a storage URL; write file:///path or s3://bucket/prefix.")


def check_writable(url: str, s3: S3Settings | None, field: str = "job.output") -> None:
    """Raise InvalidSpec unless the prefix `url` can be written (a probe object, removed)."""

    store = store_for(url, s3)
    probe = join(url, f".gpuflow-probe-{os.getpid()}")
    try:
        store.write_bytes(probe, b"ok")
        store.delete(probe)
    except (StorageError, OSError) as exc:
        raise InvalidSpec(
            f"{field}: cannot write to {url} ({exc}); fix the URL or its permissions."
        ) from None


def s3_settings(spec: Any) -> S3Settings:
    """Return the S3 settings a job spec names: its AwsCredentials block, else AWS_* variables.
    Inside a flow run the block is read once for the run: every stage, chunk and check of
    it uses what was read first (a block changed meanwhile applies from the next run)."""
    name = spec.storage.aws_credentials
    if not name:
        return S3Settings.from_env()
    run_id = _flow_run_id()
    return _settings_of_run(run_id, name) if run_id else S3Settings.from_block(name)


@functools.lru_cache(maxsize=64)
def _settings_of_run(run_id: str, name: str) -> S3Settings:
    return S3Settings.from_block(name)


def _flow_run_id() -> str | None:
    """Return the id of the flow run this code runs in (a task's too), None outside one."""
    from prefect.context import FlowRunContext, TaskRunContext

    task = TaskRunContext.get()
    if task is not None and task.task_run.flow_run_id is not None:
        return str(task.task_run.flow_run_id)
    flow = FlowRunContext.get()
    return str(flow.flow_run.id) if flow is not None and flow.flow_run is not None else None
