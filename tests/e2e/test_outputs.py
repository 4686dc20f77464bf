"""A job's outputs reach the artifacts as the job left them, never more, and what a completed
job produced is not lost to a signal: a job that swaps its outputs folder for a link to /etc
gets nothing of /etc copied; Ctrl-C while collect copies 20,000 files waits for the copy."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.helpers import nothing_left
from tests.e2e.test_first_run import GPUFLOW, fresh_env, start_run, wait_for
from tests.e2e.test_pipeline import NO_RETRY, run_pipeline

pytestmark = pytest.mark.e2e


def test_an_outputs_folder_swapped_for_a_link_copies_nothing(prefect_api, gpuflow_home):
    swap = 'echo x > "$GPUFLOW_OUTPUT_DIR/mine.txt"; rm -rf "$GPUFLOW_OUTPUT_DIR"'
    swap += ' && ln -s /etc "$GPUFLOW_OUTPUT_DIR"'
    raw = {"job": {"kind": "command", "command": ["sh", "-c", swap]}, "retry": NO_RETRY}
    state, _ = run_pipeline(raw)
    assert state.is_completed(), state.message
    out = Path(state.result().artifacts_dir)
    assert not (out / "outputs").exists()  # neither /etc's files nor a link to them
    assert not any(p.name in ("passwd", "shadow", "hostname") for p in out.rglob("*"))
    assert nothing_left(gpuflow_home)


def test_ctrl_c_while_collect_copies_keeps_every_output(tmp_path):
    files = 20_000
    home = tmp_path / "home"
    env = fresh_env(tmp_path, home) | {"GPUFLOW_API_IDLE_S": "0"}
    make = f'cd "$GPUFLOW_OUTPUT_DIR" && seq 1 {files} | xargs touch'
    proc = start_run(tmp_path, f"[sh, -c, '{make}']", env, start_new_session=True)
    copied = home / "runs"

    def copying() -> bool:
        return any(copied.glob("*/outputs"))

    wait_for(proc, copying)
    os.kill(proc.pid, signal.SIGSTOP)  # frozen in the copy: the signal lands there
    try:
        (run,) = copied.iterdir()
        partial = sum(1 for _ in (run / "outputs").iterdir()) < files
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert sorted(int(p.name) for p in (run / "outputs").iterdir()) == list(range(1, files + 1))
    if partial:  # as good as always: 20,000 files take far longer than one look
        assert "[gpuflow] stopping once the job's outputs are copied to the artifacts" in out
    assert not list((home / "workspaces").iterdir())  # teardown still ran, after the copy


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_full_artifacts_disk_keeps_the_outputs_whole_and_says_where(
    prefect_api, gpuflow_home, tmp_path
):
    import subprocess

    from gpuflow.tasks.errors import CollectError

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        write = 'head -c 3000000 /dev/urandom > "$GPUFLOW_OUTPUT_DIR/model.bin"'
        raw = {
            "job": {"kind": "command", "command": ["sh", "-c", write]},
            "storage": {"artifacts": f"file://{small}"},
            "retry": NO_RETRY,
        }
        state, _ = run_pipeline(raw)
        assert state.is_failed()
        error = state.result(raise_on_failure=False)
        assert isinstance(error, CollectError), error
        said = str(error)
        assert f"could not be written to {small}" in said and "No space left on device" in said
        assert "ended with exit code 0; its outputs are kept whole in " in said
        kept = Path(said.split("its outputs are kept whole in ")[1].rstrip("."))
        assert kept.parent == gpuflow_home / "kept"
        assert (kept / "model.bin").stat().st_size == 3_000_000
        assert not list(small.rglob("model.bin*"))  # nothing truncated under its name
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_full_gpuflow_home_is_one_sentence_and_the_outputs_are_kept_whole(prefect_api, tmp_path):
    """GPUFLOW_HOME on an 8 MiB disk, which the job fills: the run fails with one sentence
    naming the full folder (never a traceback), what the job wrote is kept whole, and no
    half-written file of gpuflow's stays."""
    import subprocess

    from tests.conftest import subprocess_env

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        job = tmp_path / "fill.yaml"
        fill = "head -c 20000000 /dev/zero > $GPUFLOW_OUTPUT_DIR/big.bin; echo filled"
        job.write_text(
            f"resources: {{disk: 1Mi}}\nretry: {{run: {{retries: 0}}}}\n"
            f"job: {{kind: command, command: [sh, -c, '{fill}']}}\n"
        )
        env = subprocess_env(prefect_api, small / "home")
        done = subprocess.run(
            [*GPUFLOW, "run", str(job)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
        assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
        (last,) = [line for line in done.stderr.splitlines() if line.startswith("gpuflow: failed")]
        assert last.startswith(f"gpuflow: failed: the disk of {small}/home/"), last
        assert "is full (" in last and "point GPUFLOW_HOME at a disk with room" in last, last
        (kept,) = (small / "home" / "kept").iterdir()
        assert (kept / "big.bin").stat().st_size > 0
        assert not [p for p in small.rglob(".*.tmp")]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_job_s_temporary_files_go_with_its_workspace(prefect_api, gpuflow_home, tmp_path):
    """A job's TMPDIR is a folder of its own (0700, a short path: programs put Unix sockets
    there): what it leaves in its temporary folder (mktemp, Python's tempfile) is removed by
    teardown, not left in the host's /tmp."""
    said = tmp_path / "said"
    script = (
        f'mktemp > {said}; python3 -c "import tempfile; print(tempfile.gettempdir())" >> {said}'
    )
    raw = {"job": {"kind": "command", "command": ["sh", "-c", script]}, "retry": NO_RETRY}
    state, _ = run_pipeline(raw)
    assert state.is_completed(), state.message
    left, folder = said.read_text().split()
    assert Path(left).parent == Path(folder)
    assert Path(folder).name.startswith("gpuflow-job-")  # short: Unix sockets fit in it
    assert not Path(left).exists() and not Path(folder).exists()
    assert nothing_left(gpuflow_home)


def test_a_huge_result_json_is_kept_but_its_figures_are_not_shown(prefect_api, gpuflow_home):
    """A result.json over 1 MiB stays in the artifacts; its figures are not read into the
    run's metrics or artifacts (a 115 MB one was a 140-million-character artifact)."""
    big = 'python3 -c "import json; print(json.dumps({\\"x\\": \\"y\\" * 3000000}))"'
    raw = {
        "job": {
            "kind": "command",
            "command": ["sh", "-c", f'{big} > "$GPUFLOW_OUTPUT_DIR/result.json"'],
        },
        "retry": NO_RETRY,
    }
    state, _ = run_pipeline(raw)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.metrics.job == {}
    assert (Path(result.artifacts_dir) / "outputs" / "result.json").stat().st_size > 3_000_000


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a read-only folder")
def test_a_read_only_gpuflow_home_is_one_sentence(tmp_path):
    import subprocess

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(home)], check=True)
    try:
        env = fresh_env(tmp_path, home) | {"GPUFLOW_API_IDLE_S": "0"}
        proc = start_run(tmp_path, "[echo, hi]", env)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode in (1, 2), out[-3000:]
        assert "Traceback" not in out
        [said] = [line for line in out.splitlines() if line.startswith("gpuflow:")]
        assert str(home) in said and "Read-only file system" in said
    finally:
        subprocess.run(["umount", str(home)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_full_gpuflow_home_is_one_sentence_and_leaves_no_server_behind(tmp_path):
    """GPUFLOW_HOME fills up: before the first command's temporary API is recorded (the
    server is stopped, and neither a half-written record nor its log stays), and after a
    kept one was (the next command cannot write its lease on it)."""
    import subprocess

    import psutil

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(home)], check=True)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"job: {{kind: command, command: [echo, hi]}}\n"
        f"placement: {{workspace_root: {tmp_path / 'workspaces'}}}\n"
    )
    env = fresh_env(tmp_path, home) | {"GPUFLOW_API_IDLE_S": "600"}

    def run() -> tuple[int, str]:
        done = subprocess.run(
            [*GPUFLOW, "run", str(job)], env=env, capture_output=True, text=True, timeout=300
        )
        return done.returncode, done.stdout + done.stderr

    def fill() -> None:
        with open(home / "filler", "ab", buffering=0) as out:
            try:
                while True:
                    out.write(b"x" * 4096)
            except OSError:
                pass

    servers = home / "servers"
    try:
        code, out = run()
        assert code == 0, out[-3000:]
        [kept] = [json.loads(p.read_text()) for p in servers.glob("[0-9]*.json")]
        fill()
        code, out = run()  # the kept server answers, but the lease on it cannot be written
        assert code == 1, out[-3000:]
        assert "Traceback" not in out
        [said] = [line for line in out.splitlines() if line.startswith("gpuflow:")]
        assert said == (
            f"gpuflow: GPUFLOW_HOME {home} cannot hold this command's lease on the kept API"
            " (No space left on device); free space there, or point GPUFLOW_HOME at another"
            " folder."
        )
        os.kill(kept["pid"], signal.SIGTERM)
        psutil.Process(kept["pid"]).wait(timeout=60)
        for path in servers.glob("server-*.log"):
            path.unlink()
        before = {p.name for p in servers.iterdir()}
        code, out = run()  # a server starts, but its record cannot be written: it is stopped
        assert code == 1, out[-3000:]
        assert "cannot hold the temporary API's record (No space left on device)" in out
        assert {p.name for p in servers.iterdir()} == before  # no .tmp, no log
        assert not [
            p
            for p in psutil.process_iter(["cmdline", "environ"])
            if "gpuflow.tasks.platform.server" in " ".join(p.info["cmdline"] or [])
            and (p.info["environ"] or {}).get("GPUFLOW_HOME") == str(home)
        ]
    finally:
        subprocess.run(["umount", "-l", str(home)], check=True)
