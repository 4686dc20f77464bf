"""Fetching a storage prefix into a folder: render scenes and HPC inputs share one helper,
and neither lets an object's key put a file outside the folder."""

from __future__ import annotations

import boto3
import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.fetching import UnsafeKey, fetch_prefix
from gpuflow.tasks.pipeline.checks import check_job
from gpuflow.tasks.spec import load_spec
from gpuflow.tasks.storage import store_for

pytestmark = pytest.mark.e2e
CLIMBING = "../../escaped.txt"


def put(server, key: str, body: bytes = b"data") -> None:
    boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.key_id,
        aws_secret_access_key=server.secret,
    ).put_object(Bucket=server.bucket, Key=key, Body=body)


@pytest.fixture
def climbing_prefix(s3_server, request):
    """A prefix holding a good object and one whose key climbs two folders up."""
    prefix = f"climb-{request.node.name[-20:]}"
    put(s3_server, f"{prefix}/scene/shot.blend", b"BLENDER-v300")
    put(s3_server, f"{prefix}/scene/{CLIMBING}", b"not yours")
    listed = [
        o.url
        for o in store_for(s3_server.url(prefix), s3_server.settings()).list(
            s3_server.url(prefix, "scene")
        )
    ]
    assert s3_server.url(prefix, "scene", CLIMBING) in listed  # the server kept the key as written
    return prefix


@pytest.fixture
def aws_env(s3_server, monkeypatch) -> None:
    """The test S3 server's settings as AWS_* variables, as a job without a block has them."""
    for name, value in s3_server.settings().child_env().items():
        monkeypatch.setenv(name, value)


def test_a_scene_prefix_with_a_climbing_key_is_refused_before_anything_is_written(
    s3_server, climbing_prefix, gpuflow_home, aws_env
):
    spec = load_spec(
        {
            "job": {
                "kind": "render",
                "scene": s3_server.url(climbing_prefix, "scene"),
                "output": f"file://{gpuflow_home / 'out'}",
            }
        }
    )
    with pytest.raises(InvalidSpec) as refused:
        check_job(spec)
    message = str(refused.value)
    assert message.startswith("job.scene: ") and message.count(". ") == 0
    assert "would land outside the folder it is fetched into" in message
    assert "rename or remove that object" in message
    written = [p for p in gpuflow_home.rglob("*") if p.is_file()]
    assert not [p for p in written if p.name in ("escaped.txt", "shot.blend")], written


def test_hpc_inputs_with_a_climbing_key_are_refused_before_provisioning(
    s3_server, climbing_prefix, gpuflow_home, aws_env
):
    spec = load_spec(
        {
            "job": {
                "kind": "hpc",
                "program": ["true"],
                "inputs": [s3_server.url(climbing_prefix, "scene")],
            }
        }
    )
    with pytest.raises(InvalidSpec, match=r"^job\.inputs: .*would land outside the folder"):
        check_job(spec)


def test_fetch_prefix_checks_every_key_before_writing_any(s3_server, climbing_prefix, tmp_path):
    store = store_for(s3_server.url(climbing_prefix), s3_server.settings())
    folder = tmp_path / "cache" / "files"
    with pytest.raises(UnsafeKey):
        fetch_prefix(store, s3_server.url(climbing_prefix, "scene"), folder)
    assert not any(tmp_path.rglob("*.txt")) and not any(tmp_path.rglob("*.blend"))


def test_fetch_prefix_keeps_the_layout_below_the_prefix(s3_server, tmp_path):
    put(s3_server, "layout/a/b/c.txt", b"c")
    put(s3_server, "layout/top.txt", b"t")
    store = store_for(s3_server.url("layout"), s3_server.settings())
    written = fetch_prefix(store, s3_server.url("layout"), tmp_path / "into")
    assert sorted(p.relative_to(tmp_path / "into").as_posix() for p in written) == [
        "a/b/c.txt",
        "top.txt",
    ]
    assert (tmp_path / "into" / "a" / "b" / "c.txt").read_bytes() == b"c"
