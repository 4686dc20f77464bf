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
