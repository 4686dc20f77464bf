"""Shards, prepare and checkpoints: deterministic packing, skipping, validity."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.storage import FileStore
from gpuflow.tasks.training import checkpoint as ckpt
from gpuflow.tasks.training.prepare import prepare
from gpuflow.tasks.training.shards import folder_samples, pack, synthetic_samples


def test_packing_is_deterministic_and_sized():
    samples = list(synthetic_samples("classify", 50, seed=3))
    first = list(pack(samples, 20_000))
    second = list(pack(samples, 20_000))
    assert [data for data, _ in first] == [data for data, _ in second]
    assert sum(len(keys) for _, keys in first) == 50 and len(first) > 2
    with tarfile.open(fileobj=io.BytesIO(first[0][0])) as tar:
        names = tar.getnames()
    assert names[:3] == ["00000000.cls", "00000000.json", "00000000.png"]


def test_folder_groups_files_by_basename(tmp_path):
    (tmp_path / "cat.jpg").write_bytes(b"j")
    (tmp_path / "cat.txt").write_bytes(b"a cat")
    (tmp_path / "dog.jpg").write_bytes(b"d")
    (tmp_path / "README").write_bytes(b"no extension: not a sample file")
    samples = list(folder_samples(tmp_path))
    assert [s["__key__"] for s in samples] == ["cat", "dog"]
    assert samples[0]["txt"] == b"a cat" and set(samples[1]) == {"__key__", "jpg"}


def test_prepare_skips_identical_shards_and_removes_stale_ones(tmp_path):
    store, out = FileStore(), f"file://{tmp_path}/ds"
    first = prepare("synthetic:classify?samples=120", out, 20_000, store)
    assert first.written == first.shards > 3 and first.skipped == 0
    again = prepare("synthetic:classify?samples=120", out, 20_000, store)
    assert again.written == 0 and again.skipped == first.shards
    smaller = prepare("synthetic:classify?samples=40", out, 20_000, store)
    assert smaller.removed == first.shards - smaller.shards
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["samples"] == 40 and len(index["shards"]) == smaller.shards


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("synthetic:pictures", "is not a synthetic data set"),
        ("synthetic:classify?samples=0", "samples=0 .* is out of range"),
        ("/no/such/folder", "is not a folder"),
        ("synthetic:classify?samples=2&samples=3", "samples is given twice in"),
        ("synthetic:classify?samples=2&foo=1", "'foo' in .* is not a parameter of a synthetic"),
        ("synthetic:classify?=&&=", "'' in .* is not a parameter"),
        ("synthetic:lm?samples=", "samples has no value in"),
    ],
)
def test_prepare_bad_sources(source, message, tmp_path):
    with pytest.raises(InvalidSpec, match=message):
        prepare(source, f"file://{tmp_path}/ds", 20_000, FileStore())


def test_an_output_that_climbs_out_with_dots_is_refused(tmp_path):
    from gpuflow.tasks.training.prepare import check_request

    climbing = f"file://{tmp_path}/a/../../../../../etc/x"
    with pytest.raises(InvalidSpec) as refused:
        check_request("synthetic:classify?samples=2", climbing, "1MB")
    assert str(refused.value) == (
        f"output: {climbing!r} climbs out of its folder with '..'; write the folder's own"
        " absolute path."
    )


def test_prepare_empty_folder(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(InvalidSpec, match="it is empty"):
        prepare(str(tmp_path / "src"), f"file://{tmp_path}/ds", 20_000, FileStore())


def _checkpoint(store, prefix, step, manifest=True, corrupt=False):
    files = {
        name: ckpt.write_file(store, prefix, step, name, f"{name}@{step}".encode())
        for name in ("model.pt", "rank-0.pt")
    }
    if corrupt:
        store.write_bytes(f"{ckpt.step_prefix(prefix, step)}/model.pt", b"bit rot")
    if manifest:
        ckpt.write_manifest(store, prefix, step, files, {"world_size": 1})


def test_half_written_or_damaged_checkpoints_are_never_chosen(tmp_path):
    store, prefix = FileStore(), f"file://{tmp_path}/ckpt"
    _checkpoint(store, prefix, 10)
    _checkpoint(store, prefix, 20, corrupt=True)  # manifest, but a file does not match it
    _checkpoint(store, prefix, 30, manifest=False)  # died before the manifest
    step, files = ckpt.latest_valid(store, prefix)
    assert step == 10 and files["model.pt"] == b"model.pt@10"
    assert ckpt.steps(store, prefix) == [30, 20, 10]


def test_prune_keeps_the_newest_valid(tmp_path):
    store, prefix = FileStore(), f"file://{tmp_path}/ckpt"
    for step in (10, 20, 30, 40):
        _checkpoint(store, prefix, step, manifest=step != 20)
    assert ckpt.prune(store, prefix, keep=2) == [20, 10]
    assert ckpt.steps(store, prefix) == [40, 30]


def test_tar_reader_matches_tarfile_and_reads_long_names():
    from gpuflow.tasks.training.data import tar_members

    data, _ = next(pack(list(synthetic_samples("classify", 12)), 10**9))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, m.offset, tar.extractfile(m).read()) for m in tar.getmembers()]
    assert list(tar_members(io.BytesIO(data))) == expected
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
            for name in ["deep/" + "x" * 150 + ".txt", "k.cls"]:
                info = tarfile.TarInfo(name)
                info.size = 3
                tar.addfile(info, io.BytesIO(b"abc"))
        assert [n for n, _, _ in tar_members(io.BytesIO(buffer.getvalue()))] == [
            "deep/" + "x" * 150 + ".txt",
            "k.cls",
        ]


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_truncated_shard_is_skipped_or_named(policy):
    from gpuflow.tasks.training.data import DataError, tar_samples

    data, keys = next(pack(list(synthetic_samples("classify", 12)), 10**9))
    cut = io.BytesIO(data[: len(data) // 2])
    skipped = [0]
    if policy == "fail":
        with pytest.raises(
            DataError, match=r"shard s3://b/shard-000000.tar is corrupt after byte \d+"
        ):
            list(tar_samples("s3://b/shard-000000.tar", cut, policy, skipped))
    else:
        got = [s["__key__"] for s in tar_samples("s3://b/shard-000000.tar", cut, policy, skipped)]
        assert got == keys[: len(got)] and 0 < len(got) < len(keys) and skipped[0] >= 1


def test_a_link_out_of_the_source_folder_is_refused_not_packed(tmp_path):
    from gpuflow.tasks.training.prepare import open_source

    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_text("a")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not pack")
    (source / "b.txt").symlink_to(secret)
    with pytest.raises(InvalidSpec, match=r"b\.txt is a link to .*secret\.txt, outside"):
        list(open_source(str(source))[0])
    (source / "b.txt").unlink()
    (source / "inner").mkdir()
    (source / "c.txt").symlink_to(source / "a.txt")  # a link inside the folder is fine
    assert len(list(open_source(str(source))[0])) == 2


@pytest.mark.parametrize(
    "query",
    ["samples=0", "image_size=100000", "image_size=0", "classes=0", "seed=-1", "seed=99999999999"],
)
def test_synthetic_parameters_out_of_range_are_named(query):
    from gpuflow.tasks.training.prepare import open_source

    name = query.split("=")[0]
    with pytest.raises(InvalidSpec, match=f"source: {name}=.* is out of range; give"):
        open_source(f"synthetic:classify?{query}")


class _Job:
    model, model_args, task, strategy, dataset = (
        "m:small",
        {"width": 8},
        "classify",
        "ddp",
        "s3://d",
    )


_MINE = ckpt.identity(_Job, 2, "abc", "mine")


@pytest.mark.parametrize(
    ("recorded", "refused"),
    [
        ({"identity": _MINE}, None),  # this job's own
        ({"identity": {**_MINE, "job": "renamed"}}, None),  # a name is shown, not compared
        ({"identity": {**_MINE, "dataset": "s3://other"}}, "dataset s3://other), not this"),
        ({"identity": {**_MINE, "dataset_index": "def"}}, "(dataset_index def), not this"),
        ({"identity": {**_MINE, "model_args": {"width": 9}}}, 'model_args {"width": 9}'),
        ({"identity": {**_MINE, "world_size": 4}}, "(world_size 4), not this job 'mine''s"),
        ({"model": "m:small", "world_size": 2}, None),  # written before identities: model, ranks
        ({"model": "m:big", "world_size": 2}, "is job 'unknown''s (model m:big)"),
    ],
)
def test_a_checkpoint_of_another_job_is_refused_naming_both(recorded, refused):
    said = ckpt.mismatch(recorded, _MINE, "s3://o/checkpoints", 90)
    if refused is None:
        assert said is None
    else:
        assert said.startswith(
            "job.output: the newest checkpoint under s3://o/checkpoints (step 90)"
        )
        assert refused in said and said.endswith(
            "set job.checkpoint.resume: any to resume from it anyway."
        )


def test_a_decoder_whose_library_is_missing_names_it_instead_of_skipping_every_sample():
    """A missing module (Pillow in an image without it) is no corrupt sample: skipping
    would end in "no samples" and hide the cause."""
    from gpuflow.tasks.training.data import DataError, _decoded

    def decode(sample):
        raise ModuleNotFoundError("No module named 'PIL'", name="PIL")

    samples = iter([{"__key__": "a", "__url__": "file:///d/s.tar", "__offset__": 0}])
    skipped = [0]
    with pytest.raises(DataError) as raised:
        list(_decoded(decode, "skip", skipped)(samples))
    assert "the PIL module the samples are decoded with is not installed" in str(raised.value)
    assert skipped == [0]
