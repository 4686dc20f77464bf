"""A user's own code: every bad input of job.workdir, setup, launcher, ${NAME} and
metrics.from_log is one sentence before anything is made; the packed folder is the same
bytes for the same files; torchrun's units and every unit's addresses."""

from __future__ import annotations

import os
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

import gpuflow.tasks.pipeline.plugins  # noqa: F401 - the kinds and backends, for load_spec
from gpuflow.tasks.contract import Cluster, cluster_env, run_port
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.command import torchrun_units
from gpuflow.tasks.pipeline.checks import check_job, check_spec
from gpuflow.tasks.spec import load_spec
from gpuflow.tasks.workdir import WorkdirError, expand, pack, scan, variables


def command(folder: Path | None = None, **job) -> dict:
    raw = {"kind": "command", "command": ["python", "train.py"], **job}
    if folder is not None:
        raw["workdir"] = str(folder)
    return {"name": "own", "job": raw, "resources": {"gpus": 0, "allow_cpu": True}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    return code


def refused(raw: dict) -> str:
    with pytest.raises(InvalidSpec) as caught:
        check_job(load_spec(raw))
    return str(caught.value)


def test_a_workdir_that_does_not_exist_is_named(tmp_path):
    said = refused(command(tmp_path / "nowhere"))
    assert said == (
        f"job.workdir: {tmp_path}/nowhere does not exist; give the folder that holds the code."
    )


def test_a_workdir_that_is_a_file_names_its_folder(folder):
    said = refused(command(folder / "train.py"))
    assert said == (
        f"job.workdir: {folder}/train.py is a file, not a folder; give the folder that holds"
        f" it ({folder})."
    )


def test_a_workdir_over_its_limit_says_the_size_and_the_limit(folder):
    (folder / "weights.bin").write_bytes(b"\1" * 300_000)
    (folder / "ignored.bin").write_bytes(b"\1" * 900_000)
    (folder / ".gpuflowignore").write_text("ignored.bin\n")
    said = refused(command(folder, workdir_max="256Ki"))
    assert said == (
        f"job.workdir: {folder} holds more than 256.0 KiB to send (after its ignore files), its"
        f" limit; exclude what the job does not need in {folder}/.gpuflowignore, or raise"
        " job.workdir_max."
    )


def test_a_link_out_of_the_workdir_is_refused_and_one_inside_is_kept(folder, tmp_path):
    (tmp_path / "elsewhere.txt").write_text("secret\n")
    (folder / "inside.py").symlink_to("train.py")
    load_spec(command(folder))  # a link inside it is fine
    os.symlink(tmp_path / "elsewhere.txt", folder / "data.txt")
    said = refused(command(folder))
    assert said == (
        f"job.workdir: data.txt is a link to {tmp_path}/elsewhere.txt, out of {folder}; copy"
        f" what it points to into the folder, or exclude it in {folder}/.gpuflowignore."
    )
    (folder / ".gpuflowignore").write_text("data.txt\n")
    check_job(load_spec(command(folder)))


def test_a_relative_workdir_starts_at_the_spec_file(folder, tmp_path):
    spec_file = tmp_path / "jobs" / "job.yaml"
    spec_file.parent.mkdir()
    spec_file.write_text("job: {kind: command, command: [python, train.py], workdir: ../code}\n")
    assert load_spec(spec_file).job.workdir == str(folder)


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            {},
            "job.command: train.py is a path in the folder the job starts in, an empty"
            " workspace; set job.workdir to the folder that holds it (relative to the spec"
            " file), or give its absolute path.",
        ),
        (
            {"command": ["./run.sh"]},
            "job.command: ./run.sh is a path in the folder the job starts in",
        ),
    ],
)
def test_a_script_without_a_working_folder_is_refused(job, expected):
    assert refused(command(**job)).startswith(expected)


def test_a_script_missing_from_the_working_folder_is_named(folder):
    said = refused(command(folder, command=["python", "tran.py", "--epochs", "3"]))
    assert said == (
        f"job.command: tran.py is not in job.workdir ({folder}), where the job starts; fix the"
        " path, or point workdir at the folder that holds it."
    )
    said = refused(command(folder, command=["bash", "run.sh"]))
    assert said.startswith("job.command: run.sh is not in job.workdir")
    check_job(load_spec(command(folder, command=["bash", "-c", "echo hi"])))


def test_a_spec_packed_elsewhere_is_packed_again_here(folder, tmp_path, monkeypatch):
    """job.packed names an archive of this machine; a spec that names one this machine
    does not have (copied from elsewhere) is packed anew, not run without its files."""
    from gpuflow.tasks.pipeline.usercode import pack_code

    monkeypatch.setenv("GPUFLOW_HOME", str(tmp_path / "home"))
    spec, packed = pack_code(load_spec(command(folder)))
    assert packed is not None and spec.job.packed == packed.sha256
    again, none = pack_code(spec)
    assert none is None and again.job.packed == packed.sha256  # once per run
    elsewhere = load_spec(
        {**command(folder), "job": {**command(folder)["job"], "packed": "f" * 64}}
    )
    repacked, packed_here = pack_code(elsewhere)
    assert packed_here is not None and repacked.job.packed == packed.sha256


def test_torchrun_with_copies_or_on_another_kind_or_ranks_without_it_is_refused(folder):
    with pytest.raises(InvalidSpec, match=r"job\.launcher: torchrun starts the ranks itself, one"):
        load_spec(command(folder, launcher="torchrun", copies="per_node"))
    with pytest.raises(InvalidSpec, match=r"job\.launcher: unknown field; remove it"):
        load_spec({"job": {"kind": "matmul", "launcher": "torchrun"}})
    with pytest.raises(InvalidSpec, match=r"job\.ranks_per_node: sets torchrun.s ranks on each"):
        load_spec(command(folder, ranks_per_node=2))


def test_torchrun_on_two_nodes_of_a_backend_that_is_one_machine_is_refused(folder):
    raw = command(folder, launcher="torchrun")
    raw["resources"]["nodes"] = 2
    with pytest.raises(
        InvalidSpec, match=r"resources\.nodes: the local backend is this one machine"
    ):
        check_spec(load_spec(raw))


def test_a_from_log_regex_that_does_not_compile_or_names_nothing_is_refused():
    raw = command()
    raw["metrics"] = {"from_log": ["loss (?P<loss"]}
    with pytest.raises(InvalidSpec) as caught:
        load_spec(raw)
    assert str(caught.value).startswith(
        "metrics.from_log: [0] 'loss (?P<loss' is not a regular expression (missing >"
    )
    raw["metrics"] = {"from_log": [r"step (?P<step>\d+)", r"loss ([\d.]+)"]}
    with pytest.raises(InvalidSpec) as caught:
        load_spec(raw)
    assert str(caught.value) == (
        r"metrics.from_log: [1] 'loss ([\\d.]+)' has no named group, so no figure would be"
        r" kept; name what it captures, e.g. loss (?P<loss>[\d.]+)."
    )


def test_a_variable_that_is_not_set_or_a_secret_in_the_command_is_refused(folder):
    said = refused(command(folder, command=["python", "train.py", "--data", "${NOT_SET}"]))
    assert said == (
        "job.command: ${NOT_SET} is not set for the job; gpuflow expands only the spec's env"
        " and its own variables (GPUFLOW_OUTPUT_DIR, GPUFLOW_NODE_RANK, ...); add it to env,"
        " or remove it."
    )
    raw = command(folder, command=["python", "train.py", "--token", "${TOKEN}"])
    raw["secret_env"] = {"TOKEN": "hf-token"}
    assert refused(raw).startswith("job.command: ${TOKEN} is a secret (secret_env), and a")
    raw = command(folder, command="python train.py --out ${GPUFLOW_OUTPUT_DIR}/m --n ${N}")
    raw["env"] = {"N": "3"}
    check_job(load_spec(raw))  # braced names are gpuflow's; $HOME would be a shell's
    with pytest.raises(InvalidSpec, match="holds the shell syntax '\\$HOME'"):
        load_spec(command(folder, command="python train.py $HOME"))


def test_expansion_replaces_braced_names_only_and_names_what_is_missing():
    words = ["--out", "${OUT}/model", "$HOME", "${A}${B}", "{C}"]
    assert variables(words) == ["OUT", "A", "B"]
    env = {"OUT": "/o", "A": "1", "B": "2", "HOME": "/root"}
    assert expand(words, env) == ["--out", "/o/model", "$HOME", "12", "{C}"]
    with pytest.raises(KeyError, match="OUT"):
        expand(words, {})


def test_the_same_files_pack_to_the_same_bytes_and_excludes_stay_out(folder, tmp_path):
    (folder / "notes.log").write_text("left out\n")
    (folder / ".gitignore").write_text("*.log\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "config").write_text("[core]\n")
    first = pack(folder, 1 << 20, tmp_path / "a")
    os.utime(folder / "train.py", (1, 1))  # a new time, the same content
    second = pack(folder, 1 << 20, tmp_path / "b")
    assert first.sha256 == second.sha256
    assert Path(first.path).read_bytes() == Path(second.path).read_bytes()
    with tarfile.open(first.path) as tar:
        assert sorted(tar.getnames()) == [".gitignore", "train.py"]
    (folder / "train.py").write_text("print('changed')\n")
    assert pack(folder, 1 << 20, tmp_path / "c").sha256 != first.sha256


def test_the_log_names_what_the_ignore_files_left_out_and_a_bang_pattern_keeps_a_file(
    folder, tmp_path
):
    from gpuflow.tasks.pipeline.usercode import said

    (folder / "data").mkdir()
    (folder / "data" / "weights.bin").write_bytes(b"w" * 3000)
    (folder / "data" / "vocab.bin").write_bytes(b"v" * 1000)
    (folder / "run.log").write_bytes(b"l" * 10)
    (folder / ".gitignore").write_text("*.bin\n*.log\n")
    packed = pack(folder, 1 << 20, tmp_path / "a")
    assert (packed.left_out.files, packed.left_out.size) == (3, 4010)
    line = said(packed)
    assert line.endswith(
        "left out by its ignore files: 3 files, 3.9 KiB (largest: data/weights.bin 2.9 KiB,"
        " data/vocab.bin 1000 B, run.log 10 B); a `!PATTERN` line in .gpuflowignore sends a"
        " file .gitignore leaves out"
    ), line
    (folder / ".gpuflowignore").write_text("!data/vocab.bin\n")
    kept = pack(folder, 1 << 20, tmp_path / "b")
    with tarfile.open(kept.path) as tar:
        assert "data/vocab.bin" in tar.getnames() and "data/weights.bin" not in tar.getnames()
    assert kept.left_out.files == 2


def test_a_gpuflowignore_that_is_a_folder_is_one_sentence(folder):
    (folder / ".gpuflowignore").mkdir()
    with pytest.raises(WorkdirError) as refused:
        scan(folder, 1 << 20)
    assert str(refused.value) == (
        f"job.workdir: {folder}/.gpuflowignore is not a file; make it a file of patterns, one a"
        " line, as .gitignore's (a `!PATTERN` line sends what another line leaves out)"
    )


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    "plant, expected",
    [
        (
            lambda f: (f / "a").symlink_to("b") or (f / "b").symlink_to("a"),
            "job.workdir: a is a link that loops (a -> b -> ...); remove it or exclude it in"
            " {folder}/.gpuflowignore",
        ),
        (
            lambda f: (f / "root").symlink_to("/"),
            "job.workdir: root is a link to /, out of {folder}; copy what it points to into the"
            " folder, or exclude it in {folder}/.gpuflowignore",
        ),
        (
            lambda f: _fifo(f / ".gpuflowignore"),
            "job.workdir: {folder}/.gpuflowignore is not a file; make it a file of patterns, one"
            " a line, as .gitignore's (a `!PATTERN` line sends what another line leaves out)",
        ),
        (
            lambda f: (f / ".gitignore").symlink_to("/dev/zero"),
            "job.workdir: {folder}/.gitignore is not a file; make it a file of patterns, one a"
            " line, as .gitignore's (a `!PATTERN` line sends what another line leaves out)",
        ),
        (
            lambda f: (f / ".gitignore").write_text("x\n" * 600_000),
            "job.workdir: {folder}/.gitignore holds over 1.0 MiB of patterns; an ignore file"
            " that large is not one: make it a file of patterns, one a line",
        ),
    ],
    ids=["link-loop", "link-to-root", "fifo-ignore", "dev-zero-ignore", "huge-ignore"],
)
def test_a_hostile_working_folder_is_one_sentence_without_waiting(folder, plant, expected):
    """Nothing blocks on a FIFO, reads /dev/zero, follows a link out or walks a loop."""
    plant(folder)
    with pytest.raises(WorkdirError) as refused:
        scan(folder, 1 << 20)
    assert str(refused.value) == expected.format(folder=folder)


@pytest.mark.parametrize("limit", [1 << 20, 1 << 40])
def test_a_workdir_that_is_a_link_to_the_root_is_one_sentence(tmp_path, limit):
    """The walk stops at the first thing it cannot send (a link of /proc it may not read,
    one out of the folder) or once the files pass the limit: never a traceback, never the
    whole of / read."""
    (tmp_path / "everything").symlink_to("/")
    with pytest.raises(WorkdirError) as refused:
        scan(tmp_path / "everything", limit)
    said = str(refused.value)
    assert said.startswith("job.workdir: ") and "\n" not in said
    assert (
        said.startswith(f"job.workdir: {tmp_path}/everything holds more than 1.0 MiB to send")
        or "is a link that cannot be read" in said
        or "which cannot be followed" in said
        or ", out of " in said
    ), said


def cluster(nodes: int, gpus: int, rendezvous: str | None = None) -> Cluster:
    return Cluster(
        backend="kubernetes",
        name="run-1",
        owner={},
        hostname="h",
        workspace="/w",
        gpu_indices=list(range(gpus)),
        nodes=nodes,
        node_names=[f"n{i}.run-1" for i in range(nodes)],
        rendezvous=rendezvous,
        created_at=datetime.now(UTC),
    )


def test_torchrun_units_meet_at_the_first_node_with_a_rank_per_gpu():
    two = torchrun_units(["python", "ddp.py", "--lr", "0.1"], cluster(2, 8, "n0.run-1:29400"), None)
    assert [u.node for u in two] == [0, 1] and {u.world_size for u in two} == {16}
    for node, unit in enumerate(two):
        assert unit.command[1:] == [
            "-m",
            "gpuflow.tasks.torchrun",
            "--nproc-per-node=8",
            "--nnodes=2",
            f"--node-rank={node}",
            "--master-addr=n0.run-1",
            "--master-port=29400",
            "--",
            "python",
            "ddp.py",
            "--lr",
            "0.1",
        ]
    [one] = torchrun_units(["./run.sh"], cluster(1, 0), None)
    assert one.command[3:] == ["--nproc-per-node=1", "--standalone", "--", "./run.sh"]


def test_every_unit_learns_the_first_nodes_address_and_every_nodes():
    env = cluster_env(cluster(3, 1), attempt=2)
    assert env == {
        "GPUFLOW_MASTER_ADDR": "n0.run-1",
        "GPUFLOW_MASTER_PORT": "29400",
        "GPUFLOW_NODE_ADDRS": "n0.run-1,n1.run-1,n2.run-1",
        "GPUFLOW_ATTEMPT": "2",
    }
    assert cluster_env(cluster(2, 1, "10.0.0.5:21234"))["GPUFLOW_MASTER_PORT"] == "21234"


def test_a_runs_own_port_is_below_the_ephemeral_range_and_differs_between_runs():
    from uuid import NAMESPACE_URL, uuid5

    ports = {run_port(str(uuid5(NAMESPACE_URL, f"run-{i}"))) for i in range(200)}
    assert all(20000 <= p < 32000 for p in ports)  # Linux's ephemeral range starts at 32768
    assert len(ports) > 190  # 200 runs: nearly all on ports of their own
    assert run_port("a-run") == run_port("a-run")


def test_an_archive_whose_member_would_land_outside_is_refused_where_tarfile_has_no_filter(
    tmp_path,
):
    import io

    from gpuflow.tasks.workdir import _inside

    for name, link in (("../escape.txt", None), ("/etc/x", None), ("ok", "../../etc/passwd")):
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info, io.BytesIO(b""))
        data.seek(0)
        with tarfile.open(fileobj=data) as tar, pytest.raises(ValueError, match="out"):
            _inside(tar.getmembers())


def test_a_link_given_by_its_absolute_path_inside_the_folder_is_sent_as_a_relative_one(
    folder, tmp_path
):
    (folder / "lib").mkdir()
    (folder / "lib" / "model.py").write_text("X = 1\n")
    os.symlink(folder / "lib" / "model.py", folder / "model.py")
    packed = pack(folder, 1 << 20, tmp_path / "a")
    with tarfile.open(packed.path) as tar:
        assert tar.getmember("model.py").linkname == "lib/model.py"


def test_the_readmes_job_spec_is_a_valid_spec(tmp_path):
    """Every field the README shows is one the spec takes, with the values it shows."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"A job spec \(YAML or JSON.*?```yaml\n(.*?)```", readme, re.S)
    assert block is not None
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(block.group(1))
    spec = load_spec(spec_file)
    assert spec.job.workdir == str(tmp_path) and spec.job.launcher == "torchrun"
    assert spec.metrics.from_log == [r"step (?P<step>\d+) loss (?P<loss>[\d.]+)"]
    assert spec.storage.staging == "s3://bucket/gpuflow"
