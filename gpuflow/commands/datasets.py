"""`gpuflow prepare-dataset SOURCE OUTPUT`: files packed into webdataset shards in storage."""

from __future__ import annotations

import sys
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid, print_link

HELP = "pack files into webdataset shards in storage"


def add(commands: Any) -> list[tuple[str, str]]:
    prep = commands.add_parser("prepare-dataset", description=HELP[0].upper() + HELP[1:] + ".")
    prep.add_argument(
        "source", help="a folder of files grouped by basename, or synthetic:classify?samples=N"
    )
    prep.add_argument("output", help="file:///path or s3://bucket/prefix")
    prep.add_argument("--shard-size", default="256MB")
    prep.add_argument("--aws-credentials", help="name of a prefect-aws AwsCredentials block")
    prep.set_defaults(
        handler=lambda args: prepare(
            args.source, args.output, args.shard_size, args.aws_credentials
        )
    )
    return [("prepare-dataset", HELP)]


def prepare(source: str, output: str, shard_size: str, aws_credentials: str | None) -> int:
    """Shard `source` into `output` through the prepare-dataset flow."""
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.storage import S3Settings, StorageError, check_writable
    from gpuflow.tasks.training.prepare import check_request

    try:
        check_request(source, output, shard_size)
    except InvalidSpec as exc:
        return invalid(exc)

    def body(api: Any) -> int:
        from gpuflow.flows.datasets import prepare_dataset

        try:
            settings = S3Settings.from_block(aws_credentials) if aws_credentials else None
            check_writable(output, settings, "output")
        except (InvalidSpec, StorageError) as exc:
            return invalid(exc)
        with session.sentences_on_console():
            state = prepare_dataset(source, output, shard_size, aws_credentials, return_state=True)
        if state.is_completed():
            result = state.result()
            print(
                f"{result.samples} samples in {result.shards} shards ({result.written} written,"
                f" {result.skipped} unchanged)"
            )
            print(f"index: {result.index_url}")
            print_link(api, state)
            return EXIT_OK
        error = state.result(raise_on_failure=False)
        if isinstance(error, InvalidSpec):
            return invalid(error)
        print(f"gpuflow: {(state.name or 'failed').lower()}: {error}", file=sys.stderr)
        print_link(api, state, failed=True)
        return EXIT_FAILED

    return session.with_api(body)
