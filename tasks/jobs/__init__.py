"""Job kinds: each turns its spec into the command the backend runs."""

from __future__ import annotations

import sys

from tasks.spec import JobSpec


def command_for(spec: JobSpec) -> list[str]:
    """Return the argv that runs `spec`'s job in its workspace."""
    job = spec.job
    if job.kind == "command":
        return list(job.command)
    if job.kind == "matmul":
        return [
            sys.executable,
            "-m",
            "tasks.jobs.matmul",
            "--size",
            str(job.size),
            "--dtype",
            job.dtype,
            "--seconds",
            str(job.seconds),
        ]
    if job.kind == "train":
        return [
            sys.executable,
            "-m",
            "tasks.training.launch",
            "--job-json",
            job.model_dump_json(),
            "--run-name",
            spec.name,
        ]
    if job.kind == "hpc":
        return [sys.executable, "-m", "tasks.hpc.launch", "--job-json", job.model_dump_json()]
    raise ValueError(f"job kind {job.kind!r} is not one command (renders run as chunks)")


def s3_settings(spec: JobSpec):
    """Return the S3 settings for the spec: its AwsCredentials block, else AWS_* variables."""
    from tasks.storage import S3Settings

    name = spec.storage.aws_credentials
    return S3Settings.from_block(name) if name else S3Settings.from_env()


def check_job(spec: JobSpec) -> None:
    """Raise InvalidSpec when the job itself (not the host) cannot run as written."""
    if spec.storage.artifacts:
        from tasks.storage import check_writable

        check_writable(spec.storage.artifacts, None, "storage.artifacts")
    if spec.job.kind == "train":
        from tasks.storage import StorageError
        from tasks.training.validate import check_train

        try:
            settings = s3_settings(spec)
        except StorageError as exc:
            from tasks.errors import InvalidSpec

            raise InvalidSpec(str(exc)) from None
        check_train(spec, settings)
    if spec.job.kind == "render":
        from tasks.errors import InvalidSpec
        from tasks.render import scene
        from tasks.storage import StorageError, check_writable

        try:
            settings = s3_settings(spec)
            check_writable(spec.job.output, settings)
            scene.plan(spec, settings)
        except StorageError as exc:
            raise InvalidSpec(str(exc)) from None
    if spec.job.kind == "hpc":
        from tasks.errors import InvalidSpec
        from tasks.hpc.check import check_hpc
        from tasks.storage import StorageError

        try:
            check_hpc(spec, s3_settings(spec))
        except StorageError as exc:
            raise InvalidSpec(str(exc)) from None
