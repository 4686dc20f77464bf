"""The local backend against the real OS: workspaces, process groups, timeouts, checks."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuflow.tasks.backends.local.backend import LocalBackend
from gpuflow.tasks.contract import WorkUnit, owner_labels
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_job
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import process_gone


def spec_for(command, **extra):
    return load_spec({"job": {"kind": "command", "command": command}, **extra})


@pytest.fixture
def backend(gpuflow_home) -> LocalBackend:
    return LocalBackend()


def collect_lines():
    lines: list[tuple[str, str]] = []
    return lines, lambda stream, line: lines.append((stream, line))


def test_provision_is_idempotent_and_teardown_too(backend, gpuflow_home):
    spec = spec_for(["true"])
    owner = owner_labels("run-1", "job")
    first = backend.provision(spec, owner)
    again = backend.provision(spec, owner)
    assert again.workspace == first.workspace and again.adopted and not first.adopted
    assert len(list((gpuflow_home / "workspaces").iterdir())) == 1
    assert [c.name for c in backend.list_owned({"gpuflow.io/flow-run-id": "run-1"})] == [first.name]
    report = backend.teardown(first)
    assert report.removed_workspace and not Path(first.workspace).exists()
    assert backend.teardown(first).already_gone
    assert backend.list_owned({"gpuflow.io/flow-run-id": "run-1"}) == []


def unit(*command: str) -> WorkUnit:
    return WorkUnit(name="main", command=list(command))


def test_run_streams_both_streams_and_records_exit_code(backend):
    spec = spec_for(["sh"])
    cluster = backend.provision(spec, owner_labels("run-2", "job"))
    lines, sink = collect_lines()
    script = 'echo out-1; echo err-1 >&2; echo "$GPUFLOW_WORKSPACE"; pwd; exit 3'
    result = backend.run(cluster, unit("sh", "-c", script), dict(os.environ), 30, sink)
    assert result.exit_code == 3 and result.signal is None and not result.timed_out
    assert ("stdout", "out-1") in lines and ("stderr", "err-1") in lines
    assert ("stdout", cluster.workspace) in lines
    assert lines.count(("stdout", str(Path(cluster.workspace).resolve()))) >= 1
    backend.teardown(cluster)


def test_timeout_stops_the_whole_process_group(backend, tmp_path):
    cluster = backend.provision(spec_for(["sh"]), owner_labels("run-3", "job"))
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    result = backend.run(cluster, unit("sh", "-c", script), dict(os.environ), 1.0, lambda *_: None)
    assert result.timed_out
    assert result.signal == 15 or result.exit_code is not None
    grandchild = int(pidfile.read_text())
    assert (
        not psutil.pid_exists(grandchild)
        or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    )
    backend.teardown(cluster)


def test_signal_is_recorded(backend):
    cluster = backend.provision(spec_for(["sh"]), owner_labels("run-4", "job"))
    result = backend.run(
        cluster, unit("sh", "-c", "kill -9 $$"), dict(os.environ), 30, lambda *_: None
    )
    assert result.signal == 9 and result.exit_code is None
    backend.teardown(cluster)


def test_teardown_kills_a_running_job_from_another_handle(backend, tmp_path):
    """A reaper in another process has only the record on disk: that is enough."""
    import threading

    spec = spec_for(["sleep"])
    cluster = backend.provision(spec, owner_labels("run-5", "job"))
    pidfile = tmp_path / "pid"
    script = f"echo $$ > {pidfile}; exec sleep 300"
    thread = threading.Thread(
        target=backend.run,
        args=(cluster, unit("sh", "-c", script), dict(os.environ), 600, lambda *_: None),
    )
    thread.start()
    for _ in range(100):
        # the child may write its pid before run() has recorded the process group
        if (
            pidfile.exists()
            and pidfile.read_text().strip()
            and (record := backend._read_record(cluster.name)) is not None
            and record.jobs
        ):
            break
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    report = LocalBackend().teardown(backend.list_owned({"gpuflow.io/flow-run-id": "run-5"})[0])
    thread.join(timeout=20)
    assert report.killed_processes >= 1 and report.removed_workspace
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_check_command_not_found(backend):
    with pytest.raises(InvalidSpec, match=r"job.command: 'no-such-program-xyz' was not found"):
        check_job(spec_for(["no-such-program-xyz", "--flag"]))


def test_check_unwritable_workspace_root(backend, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    spec = spec_for(["true"], placement={"workspace_root": str(blocker / "ws")})
    with pytest.raises(InvalidSpec, match=r"placement.workspace_root: cannot write to"):
        backend.check(spec)
    spec = spec_for(["true"], placement={"workspace_root": "/proc/gpuflow-ws"})
    with pytest.raises(InvalidSpec, match=r"placement.workspace_root: cannot write"):
        backend.check(spec)


def test_check_full_disk(backend, tmp_path):
    spec = spec_for(
        ["true"], resources={"disk": "900Ti"}, placement={"workspace_root": str(tmp_path)}
    )
    with pytest.raises(InvalidSpec, match=r"free but resources.disk asks for 900.0 TiB"):
        backend.check(spec)
    assert list(tmp_path.iterdir()) == []  # nothing provisioned, probe removed


def test_check_gpu_job_on_a_host_without_gpus(backend, no_nvml):
    spec = spec_for(["true"], resources={"gpus": 1})
    with pytest.raises(InvalidSpec, match=r"resources.gpus: this host cannot give 1 GPU"):
        backend.check(spec)
    backend.check(spec_for(["true"], resources={"gpus": 1, "allow_cpu": True}))


def test_check_gpu_product_absent(backend, fake_nvml):
    spec = spec_for(["true"], resources={"gpus": 1, "gpu_product": "A100"})
    with pytest.raises(InvalidSpec, match=r"of NVIDIA-A100-SXM4-40GB"):
        backend.check(spec)


def test_gpu_claims_without_a_limit_and_capacity(backend, fake_nvml, prefect_api):
    spec = spec_for(["true"], resources={"gpus": 2})
    first = backend.provision(spec, owner_labels("run-6", "job"))
    assert first.gpu_indices == [0, 1] and first.gpu_lease_id is None  # no `gpu` limit exists
    from gpuflow.tasks.errors import CapacityError

    with pytest.raises(CapacityError, match="only 0 of the 2 GPU"):
        backend.provision(spec, owner_labels("run-7", "job"))
    backend.teardown(first)
    backend.teardown(backend.list_owned({"gpuflow.io/flow-run-id": "run-7"})[0])
    second = backend.provision(spec, owner_labels("run-8", "job"))
    assert second.gpu_indices == [0, 1]
    env = {**os.environ}
    lines, sink = collect_lines()
    backend.run(
        second,
        unit(sys.executable, "-c", "import os;print(os.environ['CUDA_VISIBLE_DEVICES'])"),
        env,
        30,
        sink,
    )
    assert ("stdout", "0,1") in lines
    backend.teardown(second)


def test_teardown_stops_processes_that_left_the_job_group(backend, tmp_path):
    """MPI ranks get process groups of their own, daemons call setsid: teardown still finds
    them by the workspace in their environment; a process of another workspace is spared."""
    import subprocess

    cluster = backend.provision(spec_for(["sleep"]), owner_labels("run-6", "job"))
    env = dict(os.environ, GPUFLOW_WORKSPACE=cluster.workspace)
    stray = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    other_env = dict(os.environ, GPUFLOW_WORKSPACE=str(tmp_path / "another"))
    other = subprocess.Popen(["sleep", "300"], env=other_env, start_new_session=True)
    try:
        report = backend.teardown(cluster)
        assert report.killed_processes == 1
        assert stray.wait(timeout=10) is not None
        assert other.poll() is None
    finally:
        other.kill()
        stray.kill()


ESCAPE = "setsid env -i /usr/bin/sleep 302 >/dev/null 2>&1 </dev/null & echo started"


def _sleepers_302() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.cmdline() == ["/usr/bin/sleep", "302"] and proc.status() != "zombie":
                found.append(proc)
    return found


def test_a_job_that_escapes_its_session_and_environment_is_still_torn_down(backend):
    """setsid + env -i: a new session, no GPUFLOW_WORKSPACE; the job's cgroup (or, where
    there is none, its working directory) still finds it."""
    cluster = backend.provision(spec_for(["bash"]), owner_labels("run-7", "job"))
    lines, sink = collect_lines()
    result = backend.run(cluster, unit("bash", "-c", ESCAPE), os.environ, 30, sink)
    assert result.exit_code == 0 and ("stdout", "started") in lines
    deadline = time.monotonic() + 10
    while not _sleepers_302() and time.monotonic() < deadline:
        time.sleep(0.05)
    (escaped,) = _sleepers_302()
    try:
        report = backend.teardown(cluster)
        assert report.killed_processes >= 1
        assert report.process_tracking in (
            "cgroup",
            "process groups, environment, working directory",
        )
        escaped.wait(timeout=10)
        assert not escaped.is_running()
    finally:
        with contextlib.suppress(psutil.Error):
            escaped.kill()


def _sleepers(seconds: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            command = proc.cmdline()
            if [Path(c).name for c in command[-2:]] == [
                "sleep",
                seconds,
            ] and proc.status() != "zombie":
                found.append(proc)
    return found


def test_a_stray_holding_the_output_pipes_does_not_hold_the_run(backend):
    """`setsid sleep 61 &` keeps the job's stdout and stderr open after the main process
    exits: the run ends with the main process (the stray is still running when it
    returns, so the run did not wait for it), every line is read, and teardown stops it."""
    cluster = backend.provision(spec_for(["bash"]), owner_labels("run-13", "job"))
    lines, sink = collect_lines()
    script = "setsid sleep 61 & echo main exits; echo last >&2"
    result = backend.run(cluster, unit("bash", "-c", script), os.environ, 50, sink)
    strays = _sleepers("61")
    try:
        assert result.exit_code == 0 and not result.timed_out
        assert ("stdout", "main exits") in lines and ("stderr", "last") in lines
        assert strays, "the run waited for the stray to end"
        assert any("not waited on" in line for _, line in lines)
        backend.teardown(cluster)
        for stray in strays:
            stray.wait(timeout=10)
    finally:
        for stray in strays:
            with contextlib.suppress(psutil.Error):
                stray.kill()


def test_strays_are_found_by_working_directory_without_a_cgroup(tmp_path):
    """The fallback where no cgroup can be made: a process with an empty environment whose
    working directory is in the workspace is stopped; one elsewhere is spared."""
    import subprocess

    from gpuflow.tasks.backends.local.backend import _stop_strays

    workspace = tmp_path / "ws"
    (workspace / "sub").mkdir(parents=True)
    # A shell someone opened in the workspace before the job started is not the job's.
    before = subprocess.Popen(["sleep", "300"], cwd=workspace, env={}, start_new_session=True)
    time.sleep(0.3)
    since = time.time()
    time.sleep(0.1)
    inside = subprocess.Popen(
        ["sleep", "300"], cwd=workspace / "sub", env={}, start_new_session=True
    )
    outside = subprocess.Popen(["sleep", "300"], cwd=tmp_path, env={}, start_new_session=True)
    try:
        assert _stop_strays(str(workspace), cwd_since=since) == 1
        assert inside.wait(timeout=10) is not None
        assert outside.poll() is None and before.poll() is None
    finally:
        for proc in (before, inside, outside):
            proc.kill()


def test_empty_cgroups_a_killed_process_left_are_swept_and_busy_ones_kept(tmp_path):
    import subprocess
    import uuid

    from gpuflow.tasks.backends.local import cgroups

    prefix = f"gpuflow-sweep-{uuid.uuid4().hex[:8]}-"
    empty, busy = cgroups.create(f"{prefix}empty"), cgroups.create(f"{prefix}busy")
    if not empty:
        pytest.skip("this machine lets gpuflow make no cgroup (the fallback is tested above)")
    sleeper = subprocess.Popen(
        ["sleep", "60"], preexec_fn=lambda: [cgroups.join(str(path)) for path in busy]
    )
    try:
        for path in (*empty, *busy):
            os.utime(path, (time.time() - 3600,) * 2)  # left an hour ago
        assert sorted(cgroups.sweep_empty(prefix=prefix)) == sorted(map(str, empty))
        assert not any(path.exists() for path in empty) and all(path.exists() for path in busy)
    finally:
        sleeper.kill()
        sleeper.wait()
        cgroups.stop(busy, grace_s=1)
    assert not any(path.exists() for path in busy)


def _escape_one_hierarchy(marker: str) -> str:
    """A root job that moves itself into the root of the first tracking hierarchy, clears
    its environment, leaves its workspace and its session."""
    from gpuflow.tasks.backends.local import cgroups

    (first,) = cgroups.create("gpuflow-probe-escape")[:1] or [None]
    if first is None:
        pytest.skip("this machine lets gpuflow make no cgroup")
    cgroups.stop([first, *cgroups.create("gpuflow-probe-escape")[1:]], grace_s=1)
    root = first.parent
    return (
        f"setsid sh -c 'echo $$ > {root}/cgroup.procs; cd /; exec env -i /usr/bin/sleep {marker}'"
        " >/dev/null 2>&1 </dev/null & echo started"
    )


def test_a_root_job_that_leaves_one_cgroup_hierarchy_is_still_torn_down(backend):
    """On a cgroup v1 host the job is tracked in the pids and the freezer hierarchy: moving
    itself out of one of them (root may) leaves it in the other, so teardown still stops
    it, and the report says what a root job could still do."""
    from gpuflow.tasks.backends.local import cgroups

    if os.geteuid() != 0 or len(cgroups.create("gpuflow-probe-two")) < 2:
        cgroups.stop(cgroups.create("gpuflow-probe-two"), grace_s=1)
        pytest.skip("needs root and two cgroup hierarchies (a cgroup v1 host)")
    cgroups.stop(cgroups.create("gpuflow-probe-two"), grace_s=1)
    script = _escape_one_hierarchy("303")
    cluster = backend.provision(spec_for(["sh"]), owner_labels("run-14", "job"))
    lines, sink = collect_lines()
    result = backend.run(cluster, unit("sh", "-c", script), {"PATH": os.environ["PATH"]}, 30, sink)
    assert result.exit_code == 0 and ("stdout", "started") in lines
    deadline = time.monotonic() + 10
    while not _sleepers("303") and time.monotonic() < deadline:
        time.sleep(0.05)
    (escaped,) = _sleepers("303")
    try:
        report = backend.teardown(cluster)
        escaped.wait(timeout=10)
        assert not escaped.is_running()
        assert report.killed_processes >= 1 and report.process_tracking == "cgroup"
        assert report.escapes == cgroups.ESCAPE
    finally:
        with contextlib.suppress(psutil.Error):
            escaped.kill()


def test_units_run_at_once_and_the_first_failure_stops_the_rest(backend, tmp_path):
    from gpuflow.tasks.pipeline.running import run_units

    cluster = backend.provision(spec_for(["sh"]), owner_labels("run-9", "job"))
    pidfile = tmp_path / "sleeper.pid"
    units = [
        WorkUnit(name="sleeper", command=["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"]),
        WorkUnit(name="failer", command=["sh", "-c", "sleep 1; echo broken >&2; exit 7"]),
    ]
    seen: list[tuple[str, str, str]] = []

    def sink(unit):
        return lambda stream, line: seen.append((unit.name, stream, line))

    result = run_units(backend, cluster, units, dict(os.environ), 120, sink, lambda: False, 5)
    assert result.exit_code == 7 and not result.cancelled  # the failer speaks for the job
    assert not result.timed_out  # the sleeper was stopped, not waited for until the timeout
    assert ("failer", "stderr", "broken") in seen
    assert process_gone(int(pidfile.read_text()))
    backend.teardown(cluster)


def test_units_all_succeeding_report_the_whole_span(backend):
    from gpuflow.tasks.pipeline.running import run_units

    cluster = backend.provision(spec_for(["sh"]), owner_labels("run-10", "job"))
    units = [WorkUnit(name=f"u{i}", command=["sh", "-c", f"sleep 0.{i}"]) for i in (2, 5)]
    result = run_units(
        backend, cluster, units, dict(os.environ), 60, lambda u: print, lambda: False, 5
    )
    assert result.exit_code == 0 and not result.cancelled
    assert result.duration_s >= 0.5 and result.ended_at >= result.started_at
    backend.teardown(cluster)


PROVISION_AND_DIE = """
import pathlib, sys
import gpuflow.tasks.pipeline.plugins
from gpuflow.tasks.backends.local.backend import LocalBackend
from gpuflow.tasks.contract import owner_labels
from gpuflow.tasks.spec import load_spec
spec = load_spec({"job": {"kind": "command", "command": ["true"]}})
owner = owner_labels(sys.argv[1], "t") | ({"gpuflow.io/served": "fleet"} if sys.argv[2] else {})
cluster = LocalBackend(slots=False).provision(spec, owner)
pathlib.Path(cluster.workspace, "outputs", "ckpt").write_text("step 9")
print(cluster.name)
"""


def test_a_dead_host_programs_outputs_are_set_aside_and_age_out(gpuflow_home):
    """On a fleet host, a run whose `serve` died has its outputs moved aside before its
    reap removes the workspace; a run of the host's own is left to its own reap; kept
    outputs nobody came for go after KEPT_DAYS; a name that is not a run's is refused."""
    import subprocess

    from gpuflow.tasks.backends.local import remote

    def provision(run: str, served: bool) -> str:
        argv = [sys.executable, "-c", PROVISION_AND_DIE, run, "1" if served else ""]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        return done.stdout.strip()  # the process that recorded it is gone now

    served, own = provision("run-served", True), provision("run-own", False)
    said: list[str] = []
    backend = LocalBackend(slots=False)
    remote.set_aside_orphans(backend, said.append)
    kept = remote.kept_of(served)
    assert said == [f"kept the outputs of {served} in {kept} for its orchestrator's reap"]
    assert (kept / "ckpt").read_text() == "step 9"
    own_cluster = next(c for c in backend.list_owned({}) if c.name == own)
    assert (Path(own_cluster.workspace) / "outputs" / "ckpt").exists()  # not the host's to move
    assert remote.main(["reap"]) == 0  # the workspace goes, what was kept stays
    assert (kept / "ckpt").exists() and not any(c.name == served for c in backend.list_owned({}))
    old = time.time() - (remote.KEPT_DAYS + 1) * 86400
    os.utime(kept, (old, old))
    said.clear()
    remote.set_aside_orphans(backend, said.append)
    assert said == [f"removed {kept}: no orchestrator came for it in {remote.KEPT_DAYS} days"]
    assert not kept.exists()
    with pytest.raises(InvalidSpec, match="is not the name of a run gpuflow made"):
        remote.kept_of("../../etc")
