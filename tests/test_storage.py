"""Storage over file:// and s3:// (a real S3-compatible server on loopback)."""

from __future__ import annotations

import hashlib

import pytest

from gpuflow.tasks.errors import TransientError
from gpuflow.tasks.storage import FileStore, S3Store, StorageError, store_for


@pytest.fixture(params=["file", "s3"])
def place(request, tmp_path):
    if request.param == "file":
        return FileStore(), f"file://{tmp_path}/data"
    server = request.getfixturevalue("s3_server")
    return S3Store(server.settings()), server.url(f"storage-{tmp_path.name}")


def test_write_read_list_checksum_delete(place):
    store, prefix = place
    info = store.write_bytes(f"{prefix}/a/one.bin", b"hello")
    assert info.sha256 == hashlib.sha256(b"hello").hexdigest() and info.size == 5
    store.write_bytes(f"{prefix}/b.bin", b"world!")
    assert store.read_bytes(f"{prefix}/a/one.bin") == b"hello"
    assert store.read_head(f"{prefix}/b.bin", 3) == b"wor"
    with store.open(f"{prefix}/b.bin") as stream:
        assert stream.read() == b"world!"
    assert sorted((i.url.removeprefix(prefix), i.size) for i in store.list(prefix)) == [
        ("/a/one.bin", 5),
        ("/b.bin", 6),
    ]
    assert store.checksum(f"{prefix}/b.bin") == hashlib.sha256(b"world!").hexdigest()
    assert store.checksum(f"{prefix}/missing") is None
    assert store.exists(f"{prefix}/b.bin") and not store.exists(f"{prefix}/missing")
    store.delete(f"{prefix}/b.bin")
    assert not store.exists(f"{prefix}/b.bin")


def test_upload_and_download_files(place, tmp_path):
    store, prefix = place
    source = tmp_path / "big.bin"
    source.write_bytes(bytes(range(256)) * 40_000)
    info = store.upload_file(f"{prefix}/big.bin", source)
    assert info.sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    target = tmp_path / "copy.bin"
    store.download_file(f"{prefix}/big.bin", target)
    assert target.read_bytes() == source.read_bytes()


def test_missing_object_is_one_sentence(place):
    store, prefix = place
    with pytest.raises(StorageError, match="does not exist; check the URL"):
        store.read_bytes(f"{prefix}/nope.bin")


def test_file_writes_are_atomic(tmp_path):
    store = FileStore()
    store.write_bytes(f"file://{tmp_path}/x.bin", b"1" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temporary left behind


def test_refused_credentials_are_named(s3_server):
    store = S3Store(s3_server.settings(secret="wrong-secret"))
    with pytest.raises(StorageError) as caught:
        store.list(s3_server.url("x"))
    assert "refused the credentials" in str(caught.value)
    assert "wrong-secret" not in str(caught.value)


def test_unknown_bucket_and_scheme(s3_server):
    with pytest.raises(StorageError, match="bucket of s3://no-such-bucket/k does not exist"):
        S3Store(s3_server.settings()).read_bytes("s3://no-such-bucket/k")
    with pytest.raises(StorageError, match="is not a storage URL"):
        store_for("gs://bucket/x")


def test_listing_sweeps_what_a_dead_writer_left_and_spares_a_live_one(tmp_path):
    """A writer killed between write and rename leaves `.NAME.tmp-PID`; the next listing
    of that folder (a render's or a data set's start) removes it."""
    import os
    import subprocess

    from gpuflow.tasks.storage import FileStore

    gone = subprocess.Popen(["true"])
    gone.wait()
    store = FileStore()
    store.write_bytes(f"file://{tmp_path}/frame_0001.png", b"whole")
    dead = tmp_path / f".frame_0002.png.tmp-{gone.pid}"
    dead.write_bytes(b"half")
    live = tmp_path / f".frame_0003.png.tmp-{os.getpid()}"
    live.write_bytes(b"being written")
    listed = [info.url.rsplit("/", 1)[-1] for info in store.list(f"file://{tmp_path}")]
    assert listed == ["frame_0001.png"]
    assert not dead.exists() and live.exists()


def _s3_error(status: int, code: str):
    from botocore.awsrequest import AWSResponse

    xml = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()

    class Raw:
        def stream(self, **_):
            yield xml

    return lambda request: AWSResponse(request.url, status, {"Content-Type": "text/xml"}, Raw())


def test_s3_slowdown_and_500_during_uploads_are_retried(s3_server, tmp_path):
    """S3 answers PutObject with SlowDown twice and 500 once (botocore's before-send event):
    the frame or checkpoint upload backs off and lands whole; an S3 that keeps refusing
    leaves no object under the final name and one sentence."""
    store = S3Store(s3_server.settings())
    answers = [_s3_error(503, "SlowDown")] * 2 + [_s3_error(500, "InternalError")]
    calls: list[int] = []

    def flaky(request, **kwargs):
        calls.append(1)
        return answers.pop(0)(request) if answers else None

    store.client.meta.events.register("before-send.s3.PutObject", flaky)
    source = tmp_path / "frame.png"
    source.write_bytes(bytes(range(256)) * 4_000)
    url = s3_server.url("uploads", "frame.png")
    info = store.upload_file(url, source)
    assert len(calls) == 4
    assert store.read_bytes(url) == source.read_bytes()
    assert store.checksum(url) == info.sha256
    answers.extend([_s3_error(503, "SlowDown")] * 20)
    refused = s3_server.url("uploads", "never.png")
    with pytest.raises(TransientError) as caught:  # retryable: the stage's retry tries again
        store.write_bytes(refused, b"x" * 1000)
    assert "SlowDown" in str(caught.value) and "\n" not in str(caught.value)
    assert store.checksum(refused) is None
