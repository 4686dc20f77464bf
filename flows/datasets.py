"""prepare_dataset: pack a source into webdataset shards with an index, in storage."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_run

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.stages import retry_when_retryable
from gpuflow.tasks.platform.confine import confine_paths
from gpuflow.tasks.platform.state import users_path
from gpuflow.tasks.platform.users import UserBook
from gpuflow.tasks.storage import S3Settings, StorageError, store_for
from gpuflow.tasks.training.prepare import PrepareResult, check_request, prepare
from gpuflow.tasks.units import format_bytes


@task(
    name="pack-and-upload",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_when_retryable,
)
def pack_and_upload(
    source: str, output: str, shard_bytes: int, aws_credentials: str | None
) -> PrepareResult:
    """Return what was packed; shards already in storage with the same sha256 are skipped."""
    settings = S3Settings.from_block(aws_credentials) if aws_credentials else None
    return prepare(source, output, shard_bytes, store_for(output, settings))


@flow(name="prepare-dataset")
def prepare_dataset(
    source: str,
    output: str,
    shard_size: str = "256MB",
    aws_credentials: str | None = None,
) -> PrepareResult:
    """Pack `source` (a folder of files grouped by basename, or synthetic:classify?samples=N)
    into webdataset shards of about `shard_size` under `output` (file:// or s3://)."""
    shard_bytes = check_request(source, output, shard_size)
    tags = list(current_run.tags or [])
    fields = {"source": source, "output": output}
    confine_paths(fields, {"aws_credentials": aws_credentials}, tags, UserBook(users_path()))
    try:
        result = pack_and_upload(source, output.rstrip("/"), shard_bytes, aws_credentials)
    except StorageError as exc:
        raise InvalidSpec(f"output: {exc}") from None
    get_run_logger().info(
        "%d shards (%d written, %d unchanged), %d samples, %s at %s",
        result.shards,
        result.written,
        result.skipped,
        result.samples,
        format_bytes(result.bytes),
        result.index_url,
    )
    create_markdown_artifact(
        key="gpuflow-dataset",
        markdown=(
            f"# data set at {output}\n\n- {result.samples} samples in {result.shards} shards"
            f" ({format_bytes(result.bytes)})\n- written {result.written}, unchanged {result.skipped},"
            f" removed {result.removed}\n- index: {result.index_url}"
        ),
    )
    return result
