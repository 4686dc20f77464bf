"""gpuflow's own state files: made for this user alone, and read without ever blocking on
something that is not a plain file of this user's (a FIFO, a link, a folder)."""

from __future__ import annotations

import os

import pytest

from gpuflow.tasks.host import (
    StateFileError,
    private_dir,
    read_private,
    read_state_json,
    write_atomic,
)

ODD = {
    "a FIFO": (lambda path: os.mkfifo(path), "is not a regular file"),
    "a folder": (lambda path: path.mkdir(), "is not a regular file"),
    "a link": (lambda path: os.symlink("/etc/hostname", path), "is a symbolic link"),
}


@pytest.mark.parametrize("case", list(ODD))
def test_something_odd_where_a_state_file_should_be_is_refused_at_once(case, tmp_path):
    make, said = ODD[case]
    path = tmp_path / "state.json"
    make(path)
    with pytest.raises(StateFileError, match=said):
        read_private(path)
    with pytest.raises(StateFileError):
        read_state_json(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user's")
def test_a_state_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{}")
    os.chown(path, 65534, 65534)
    with pytest.raises(StateFileError, match="belongs to uid 65534, not to you"):
        read_private(path)


def test_half_written_or_not_an_object_reads_as_none(tmp_path):
    path = tmp_path / "state.json"
    assert read_state_json(path) is None  # none there
    for text in ('{"pid": 1', "[1, 2]", "[" * 100_000):
        write_atomic(path, text)
        assert read_state_json(path) is None
    write_atomic(path, '{"pid": 1}')
    assert read_state_json(path) == {"pid": 1}


def test_state_is_written_for_this_user_alone(tmp_path):
    folder = tmp_path / "wide"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert private_dir(folder).stat().st_mode & 0o777 == 0o700  # narrowed
    write_atomic(folder / "sub" / "record.json", "{}")
    assert (folder / "sub").stat().st_mode & 0o777 == 0o700
    assert (folder / "sub" / "record.json").stat().st_mode & 0o777 == 0o600
    os.symlink("/etc/hostname", folder / "sub" / f".other.json.{os.getpid()}.tmp")
    write_atomic(folder / "sub" / "other.json", "{}")  # never writes through a link left there
    assert (folder / "sub" / "other.json").read_text() == "{}"
    (folder / "file").write_text("x")
    with pytest.raises(StateFileError, match="is not a folder"):
        private_dir(folder / "file")


def test_a_zombie_is_not_alive():
    """A process that ended but was not collected by its parent (a zombie) counts as gone:
    `gpuflow reap` then cleans up after an orchestrator that is only a zombie."""
    import time

    import psutil

    from gpuflow.tasks.host import alive, same_process

    pid = os.fork()
    if pid == 0:  # the child ends at once; the parent does not collect it yet
        os._exit(0)
    try:
        started = psutil.Process(pid).create_time()
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        assert not alive(pid, started)
        assert same_process(pid, started)  # still that process: its group may be stopped
    finally:
        os.waitpid(pid, 0)
    assert not alive(pid, started)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make folders of another user's")
def test_a_planted_gpuflow_or_prefect_home_is_refused_before_anything_is_written(tmp_path):
    """Another user's GPUFLOW_HOME gets nothing written into it; another user's PREFECT_HOME
    (or their database in a folder of the victim's) gets no server started on it: that user
    could read the Secret blocks and the key in the database."""
    import subprocess
    import sys

    def foreign(path, mode):
        path.mkdir(mode=mode)
        path.chmod(mode)
        os.chown(path, 65534, 65534)
        return path

    job = tmp_path / "job.yaml"
    job.write_text("job: {kind: command, command: [echo, hi]}\n")
    mine = tmp_path / "mine"
    plant = foreign(tmp_path / "planted", 0o777)
    (plant / "prefect.db").touch()
    (plant / "prefect.db").chmod(0o666)
    os.chown(plant / "prefect.db", 65534, 65534)

    def run(gpuflow_home, prefect_home) -> str:
        env = {**os.environ, "GPUFLOW_HOME": str(gpuflow_home), "PREFECT_HOME": str(prefect_home)}
        env.pop("PREFECT_API_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "gpuflow.cli", "run", str(job)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        return done.stderr.strip()

    said = run(plant, tmp_path / "prefect")
    assert said == (
        f"gpuflow: invalid input: {plant} belongs to uid 65534, not to you: another user could"
        " read your runs and secrets there; point GPUFLOW_HOME at a folder of your own."
    )
    assert [p.name for p in plant.iterdir()] == ["prefect.db"]  # nothing made in it
    said = run(mine, plant)
    assert said.endswith(
        f"gpuflow: PREFECT_HOME {plant} belongs to uid 65534, not to you: that user could read"
        " your Secret blocks in its database; point PREFECT_HOME at a folder of your own, or"
        " unset it (~/.prefect)."
    ), said
    os.chown(plant, 0, 0)  # the victim's own folder, with another user's database in it
    said = run(mine, plant)
    assert said.endswith(
        f"gpuflow: {plant}/prefect.db is not a database file of yours (uid 65534, mode"
        " -rw-rw-rw-): another user could read your Secret blocks in it; remove it, or point"
        " PREFECT_HOME at a folder of your own, or unset it (~/.prefect)."
    ), said
    assert plant.stat().st_mode & 0o777 == 0o700  # the victim's folder: narrowed
    assert (plant / "prefect.db").stat().st_size == 0  # no server opened it
