"""gpu_pipeline end to end against a real Prefect server: completion, failures at every
stage, retries that adopt, secrets. Cleanup is checked on the OS and in the API."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.backends.local import gpu_slots
from gpuflow.tasks.backends.local.backend import LocalBackend
from gpuflow.tasks.errors import (
    CapacityError,
    CollectError,
    InvalidSpec,
    JobFailed,
    PreflightFailed,
    ProvisionError,
)
from gpuflow.tasks.pipeline import collect as collect_stage
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import (
    NOTHING_LEFT,
    artifacts_of,
    leftovers,
    logs_of,
    nothing_left,
    process_gone,
    task_runs_of,
)

pytestmark = pytest.mark.e2e
NO_RETRY = {s: {"retries": 0} for s in ("provision", "preflight", "run", "collect")}


def run_pipeline(raw: dict):
    state = gpu_pipeline(load_spec(raw), return_state=True)
    return state, state.state_details.flow_run_id


def test_smoke_job_completes_with_artifacts(prefect_api, gpuflow_home, no_nvml):
    raw = {
        "name": "smoke",
        "job": {"kind": "matmul", "size": 256, "seconds": 1},
        "resources": {"gpus": 1, "allow_cpu": True},
        "metrics": {"interval_s": 0.2},
    }
    state, run_id = run_pipeline(raw)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.preflight == "warn"  # no GPU here, continuing on CPU
    assert result.metrics.job["tflops"] > 0 and result.metrics.job["device"] == "cpu"
    assert result.metrics.samples >= 2 and not result.metrics.gpu_seen
    out = Path(result.artifacts_dir)
    assert {p.name for p in out.iterdir()} >= {
        "metrics.json",
        "metrics.prom",
        "samples.jsonl",
        "utilisation.png",
        "outputs",
    }
    assert json.loads((out / "outputs" / "result.json").read_text())["size"] == 256
    assert set(artifacts_of(run_id)) >= {"gpuflow-preflight", "gpuflow-metrics", "gpuflow-summary"}
    assert "TFLOP/s" in artifacts_of(run_id)["gpuflow-summary"].data
    assert nothing_left(gpuflow_home)


def _fail_provision_after_everything(monkeypatch):
    real = LocalBackend._save

    def save(self, cluster, complete):
        real(self, cluster, complete)
        if complete:
            raise ProvisionError("injected provision failure")

    monkeypatch.setattr(LocalBackend, "_save", save)


def _fail_collect(monkeypatch):
    def boom(*args, **kwargs):
        raise CollectError("injected collect failure")

    monkeypatch.setattr(collect_stage, "summarise", boom)


STAGES = {
    "provision": (_fail_provision_after_everything, ["true"], False, ProvisionError),
    "preflight": (None, ["true"], True, PreflightFailed),  # torch cannot see the fake GPUs
    "run": (None, ["sh", "-c", "echo $$ > {pidfile}; exit 3"], False, JobFailed),
    "collect": (_fail_collect, ["sh", "-c", "echo $$ > {pidfile}"], False, CollectError),
}


@pytest.mark.parametrize(
    "written, said",
    [
        ("{oops", "the job wrote an unreadable result.json: Expecting property name"),
        ("[" * 100_000, "the job wrote an unreadable result.json: maximum recursion depth"),
        ("[1, 2]", "the job wrote a result.json that is not a JSON object: write its figures"),
    ],
    ids=["not-json", "nested-too-deep", "a-list"],
)
def test_a_result_json_gpuflow_cannot_read_is_one_sentence(
    written, said, prefect_api, gpuflow_home, tmp_path
):
    (tmp_path / "result").write_text(written)
    copy = f'cp {tmp_path / "result"} "$GPUFLOW_OUTPUT_DIR/result.json"'
    raw = {"job": {"kind": "command", "command": ["sh", "-c", copy]}, "retry": NO_RETRY}
    state, _ = run_pipeline(raw)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, CollectError) and str(error).startswith(said), error
    assert "\n" not in str(error)
    assert nothing_left(gpuflow_home)


@pytest.mark.parametrize("stage", list(STAGES))
def test_failure_at_each_stage_leaves_nothing(
    stage, prefect_api, gpuflow_home, fake_nvml, gpu_limit, monkeypatch, tmp_path
):
    inject, command, torch, error = STAGES[stage]
    if inject:
        inject(monkeypatch)
    pidfile = tmp_path / "pid"
    held = []
    real_acquire = gpu_slots.acquire

    def acquire(*args, **kwargs):
        lease = real_acquire(*args, **kwargs)
        held.append(gpu_slots.slots_in_use())
        return lease

    monkeypatch.setattr(gpu_slots, "acquire", acquire)
    raw = {
        "job": {
            "kind": "command",
            "command": [c.format(pidfile=pidfile) for c in command],
            "torch": torch,
        },
        "resources": {"gpus": 2},
        "retry": NO_RETRY,
    }
    state, run_id = run_pipeline(raw)
    assert state.is_failed()
    assert isinstance(state.result(raise_on_failure=False), error)
    assert held == [2], "the run held both GPU slots while it ran"
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert gpu_slots.slots_in_use() == 0
    if pidfile.exists():
        assert process_gone(int(pidfile.read_text()))
    teardown_runs = [t for t in task_runs_of(run_id) if t.name.startswith("teardown")]
    assert teardown_runs and teardown_runs[0].state.is_completed()


def test_retried_provision_adopts_its_workspace(
    prefect_api, gpuflow_home, fake_nvml, gpu_limit, monkeypatch
):
    calls = []
    real_acquire = gpu_slots.acquire

    def flaky(*args, **kwargs):
        calls.append(sorted(p.name for p in (gpuflow_home / "workspaces").iterdir()))
        if len(calls) == 1:
            raise CapacityError("injected: slots busy")
        return real_acquire(*args, **kwargs)

    monkeypatch.setattr(gpu_slots, "acquire", flaky)
    raw = {
        "job": {"kind": "command", "command": ["true"]},
        "resources": {"gpus": 1},
        "retry": {"provision": {"retries": 2, "delay_s": 0.01, "jitter": 0}},
    }
    state, run_id = run_pipeline(raw)
    assert state.is_completed(), state.message
    assert len(calls) == 2 and calls[0] == calls[1] and len(calls[0]) == 1  # one workspace, reused
    assert state.result().cluster.adopted
    provision_run = next(t for t in task_runs_of(run_id) if t.name.startswith("provision"))
    assert provision_run.run_count == 2
    assert nothing_left(gpuflow_home) and gpu_slots.slots_in_use() == 0


def test_job_failure_is_not_retried(prefect_api, gpuflow_home, tmp_path):
    counter = tmp_path / "count"
    raw = {"job": {"kind": "command", "command": ["sh", "-c", f"echo x >> {counter}; exit 2"]}}
    state, _ = run_pipeline(raw)
    assert state.is_failed()
    assert "exited with code 2" in str(state.result(raise_on_failure=False))
    assert counter.read_text().count("x") == 1


def test_preempted_job_is_retried(prefect_api, gpuflow_home, tmp_path):
    marker = tmp_path / "interrupted-once"
    script = f"if [ -e {marker} ]; then echo resumed; else touch {marker}; exit 75; fi"
    raw = {
        "job": {"kind": "command", "command": ["sh", "-c", script]},
        "retry": {"run": {"retries": 2, "delay_s": 0.01}},
    }
    state, run_id = run_pipeline(raw)
    assert state.is_completed(), state.message
    assert any("resumed" in line for line in logs_of(run_id))


def test_a_preemption_past_the_last_retry_does_not_promise_one(prefect_api, gpuflow_home):
    """... and keeps what the job saved: its checkpoint is in the run's artifacts."""
    saved = 'echo "step $GPUFLOW_ATTEMPT" > "$GPUFLOW_OUTPUT_DIR/checkpoint.txt"; exit 75'
    raw = {
        "job": {"kind": "command", "command": ["sh", "-c", saved]},
        "retry": {"run": {"retries": 1, "delay_s": 0.01}},
    }
    state, run_id = run_pipeline(raw)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed()
    assert "its retries are used up (retry.run.retries)" in message, message
    assert "a retry resumes it" not in message
    logs = logs_of(run_id)
    assert any("a retry resumes it" in line for line in logs)  # the first try
    (kept,) = (gpuflow_home / "runs").glob(f"*-{str(run_id)[:8]}/outputs/checkpoint.txt")
    assert kept.read_text() == "step 2\n"  # the last attempt's
    assert any("the job's outputs were kept: 1 file(s)" in line for line in logs), logs


def test_a_secret_too_short_to_mask_is_refused_before_provisioning(prefect_api, gpuflow_home):
    from prefect.blocks.system import Secret

    Secret(value="abc").save("gpuflow-test-short", overwrite=True)
    raw = {
        "job": {"kind": "command", "command": ["sh", "-c", "echo $PIN"]},
        "secret_env": {"PIN": "gpuflow-test-short"},
    }
    state, _ = run_pipeline(raw)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, InvalidSpec)
    assert "secret_env.PIN: the secret in 'gpuflow-test-short' is shorter than 4" in str(error)
    assert "abc" not in str(error)
    assert nothing_left(gpuflow_home)


def test_secrets_never_reach_logs_or_artifacts(prefect_api, gpuflow_home):
    from prefect.blocks.system import Secret

    value = "tok-9f8e7d6c5b4a-SECRET"
    Secret(value=value).save("gpuflow-test-token", overwrite=True)
    script = 'echo "token is $HF_TOKEN"; env; echo "$HF_TOKEN" >&2; echo "$HF_TOKEN" > "$GPUFLOW_OUTPUT_DIR/leak.txt"; exit 1'
    raw = {
        "name": "secretive",
        "job": {"kind": "command", "command": ["sh", "-c", script]},
        "secret_env": {"HF_TOKEN": "gpuflow-test-token"},
    }
    state, run_id = run_pipeline(raw)
    assert state.is_failed()  # exit 1: its log tail goes into the error text too
    logs = logs_of(run_id)
    assert any("token is ***" in line for line in logs)
    assert not any(value in line for line in logs)
    assert value not in str(state.result(raise_on_failure=False))
    for artifact in artifacts_of(run_id).values():
        assert value not in json.dumps(artifact.data)
    for task_run in task_runs_of(run_id):
        assert value not in json.dumps(task_run.model_dump(mode="json"))
    out = next((gpuflow_home / "runs").iterdir())
    for path in out.rglob("*"):
        if path.is_file() and path.name != "leak.txt":  # the job's own output is the job's business
            assert value.encode() not in path.read_bytes(), path


def test_multi_line_and_json_secrets_are_masked_line_by_line_and_leaf_by_leaf(
    prefect_api, gpuflow_home
):
    from prefect.blocks.system import Secret

    key = (
        "-----BEGIN KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\nAQEFAASCBKcwggSjAgEAAoIB\n-----END KEY-----"
    )
    Secret(value=key).save("gpuflow-test-key", overwrite=True)
    Secret(value={"api_key": "ak-7d1e0c55f2", "nested": {"token": "tk-90ab17cd"}}).save(
        "gpuflow-test-json", overwrite=True
    )
    program = (
        "import json, os, sys\n"
        "creds = json.loads(os.environ['CREDS'])\n"
        "print('parsed api_key of', len(creds['api_key']), 'chars')\n"
        "print(os.environ['KEY']); print(creds['nested']['token'], file=sys.stderr)\n"
        "print(creds['api_key'])\n"
        "open(os.environ['GPUFLOW_OUTPUT_DIR'] + '/error.txt', 'w').write("
        "'bad key ' + os.environ['KEY'] + ' ' + creds['api_key'])\n"
        "sys.exit(3)\n"
    )
    raw = {
        "name": "secretive-json",
        "job": {"kind": "command", "command": [sys.executable, "-c", program]},
        "secret_env": {"KEY": "gpuflow-test-key", "CREDS": "gpuflow-test-json"},
    }
    state, run_id = run_pipeline(raw)
    assert state.is_failed()
    logs = "\n".join(logs_of(run_id))
    assert "parsed api_key of 13 chars" in logs  # the JSON secret reached the job as JSON
    leaks = ["MIIEvQIBADANBgkqhkiG9w0B", "AQEFAASCBKcwggSjAgEAAoIB", "ak-7d1e0c55f2", "tk-90ab17cd"]
    failure = str(state.result(raise_on_failure=False))
    assert "bad key" in failure
    for leak in leaks:
        assert leak not in logs and leak not in failure
        for artifact in artifacts_of(run_id).values():
            assert leak not in json.dumps(artifact.data)
        out = next((gpuflow_home / "runs").iterdir())
        for path in out.rglob("*"):
            assert not path.is_file() or leak.encode() not in path.read_bytes(), path
    assert "***" in (out / "outputs" / "error.txt").read_text()


def test_missing_secret_block_fails_before_provisioning(prefect_api, gpuflow_home):
    raw = {
        "job": {"kind": "command", "command": ["true"]},
        "secret_env": {"TOKEN": "no-such-block"},
    }
    state, _ = run_pipeline(raw)
    assert "secret_env.TOKEN: there is no Prefect Secret block named 'no-such-block'" in str(
        state.result(raise_on_failure=False)
    )
    assert nothing_left(gpuflow_home)


def test_max_duration_stops_the_job(prefect_api, gpuflow_home):
    raw = {"job": {"kind": "command", "command": ["sleep", "60"]}, "limits": {"max_duration": "1s"}}
    started = time.monotonic()
    state, _ = run_pipeline(raw)
    assert state.is_failed()
    assert "ran past limits.max_duration" in str(state.result(raise_on_failure=False))
    assert time.monotonic() - started < 50
    assert nothing_left(gpuflow_home)


def test_python_is_the_venv_python():
    # the job's interpreter must be the one with gpuflow installed, not its symlink target
    assert Path(sys.executable).exists()


def test_placement_block_sets_workspace_and_price(prefect_api, gpuflow_home, fake_nvml, tmp_path):
    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost(workspace_root=str(tmp_path / "scratch"), gpu_hourly_usd=3.6).save(
        "gpuflow-test-host", overwrite=True
    )
    raw = {
        "job": {"kind": "command", "command": ["true"]},
        "resources": {"gpus": 1},
        "placement": {"block": "gpuflow-test-host"},
    }
    state, _ = run_pipeline(raw)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.cluster.workspace.startswith(str(tmp_path / "scratch"))
    assert result.metrics.cost_hourly_usd == pytest.approx(3.6)
    assert result.metrics.cost_usd == pytest.approx(3.6 * result.metrics.duration_s / 3600)


def test_missing_placement_block_is_invalid_input(prefect_api, gpuflow_home):
    raw = {"job": {"kind": "command", "command": ["true"]}, "placement": {"block": "no-such-host"}}
    state, _ = run_pipeline(raw)
    assert "placement.block: there is no LocalGpuHost block named 'no-such-host'" in str(
        state.result(raise_on_failure=False)
    )
    assert nothing_left(gpuflow_home)


def test_strict_gpu_limit_without_the_limit_is_invalid_input(prefect_api, gpuflow_home, fake_nvml):
    raw = {
        "job": {"kind": "command", "command": ["true"]},
        "resources": {"gpus": 1},
        "placement": {"strict_gpu_limit": True},
    }
    state, _ = run_pipeline(raw)
    assert "the Prefect concurrency limit 'gpu' does not exist" in str(
        state.result(raise_on_failure=False)
    )
    assert nothing_left(gpuflow_home)


def test_max_cost_stops_the_job(prefect_api, gpuflow_home, fake_nvml):
    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost(gpu_hourly_usd=3600.0).save("gpuflow-pricey-host", overwrite=True)  # $1 a second
    raw = {
        "job": {"kind": "command", "command": ["sleep", "60"]},
        "resources": {"gpus": 1},
        "placement": {"block": "gpuflow-pricey-host"},
        "limits": {"max_cost_usd": 1.5},
    }
    state, _ = run_pipeline(raw)
    assert "ran past limits.max_cost_usd" in str(state.result(raise_on_failure=False))
    assert nothing_left(gpuflow_home)


def test_crash_hook_tears_down_by_labels(gpuflow_home, tmp_path):
    """on_crashed / on_cancellation get only the flow run: labels lead to the resources."""
    import types
    import uuid

    from gpuflow.flows.pipeline import _teardown_hook
    from gpuflow.tasks.contract import owner_labels

    run_id = str(uuid.uuid4())
    spec = load_spec({"job": {"kind": "command", "command": ["true"]}})
    LocalBackend().provision(spec, owner_labels(run_id, "job"))
    other = LocalBackend().provision(spec, owner_labels(str(uuid.uuid4()), "job"))
    flow_run = types.SimpleNamespace(id=uuid.UUID(run_id), parameters={"spec": spec.model_dump()})
    _teardown_hook(None, flow_run, None)
    assert leftovers(gpuflow_home)["workspaces"] == [Path(other.workspace).name]  # only its own


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (  # a real segmentation fault
            [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"],
            "the job failed (signal 11): the program crashed (segmentation fault)",
        ),
        (  # a real missing module
            [sys.executable, "-c", "import gpuflow_no_such_module"],
            "the job failed (exit 1): Python module gpuflow_no_such_module is not installed"
            " where the job runs; add it to the job's image or environment",
        ),
        (  # a real "no space left" from the kernel (/dev/full always is)
            [sys.executable, "-c", "f = open('/dev/full', 'w'); f.write('checkpoint'); f.flush()"],
            "the job failed (exit 1): the disk filled up; raise resources.disk",
        ),
    ],
    ids=["segfault", "missing-module", "disk-full"],
)
def test_a_failure_is_explained_with_its_cause_and_fix(prefect_api, gpuflow_home, command, said):
    from tests.e2e.helpers import artifacts_of

    state, run_id = run_pipeline({"job": {"kind": "command", "command": command}})
    assert state.is_failed()
    assert said in state.message  # the run's state message
    assert said in str(artifacts_of(run_id)["gpuflow-summary"].data)  # the summary artifact


SAVES_ON_SIGTERM = """
import os, signal, sys, time
def save(*_):
    with open(os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "saved.txt"), "w") as f:
        f.write("checkpoint")
    sys.exit(75)
signal.signal(signal.SIGTERM, save)
print("working", flush=True)
time.sleep(120)
"""


def _idle_spec(command: list[str], action: str) -> dict:
    return {
        "name": "idler",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1},
        "metrics": {"interval_s": 0.1},
        "limits": {"idle_gpu": {"below_pct": 5, "for": "1s", "action": action}},
        "retry": {"run": {"retries": 2, "delay_s": 0.01}},
    }


def test_idle_gpus_stop_the_job_which_saves_first(prefect_api, gpuflow_home, fake_nvml):
    """A job holding a GPU at 0 % is warned about, gets SIGTERM (it saves), and the run
    ends saying why; the exit 75 of its save is not taken for a preemption to retry."""
    from tests.e2e.helpers import artifacts_of, events_named, logs_of, task_runs_of

    fake_nvml.config["util"] = 0
    state, run_id = run_pipeline(_idle_spec([sys.executable, "-c", SAVES_ON_SIGTERM], "stop"))
    assert state.is_failed()
    assert "the job was stopped because its GPUs (0) were under 5% busy" in state.message
    assert "raise limits.idle_gpu.for" in state.message
    assert "was stopped because" in str(artifacts_of(run_id)["gpuflow-summary"].data)
    [run_task] = [t for t in task_runs_of(run_id) if t.name.startswith("run")]
    assert run_task.run_count == 1  # not retried
    saved = list((gpuflow_home / "runs").glob("idler-*/outputs/saved.txt"))
    assert [p.read_text() for p in saved] == ["checkpoint"]
    assert any("idle GPUs:" in line and "stopping the job" in line for line in logs_of(run_id))
    [event] = events_named("gpuflow.gpu.idle", f"gpuflow.run.{run_id}")
    assert event["payload"]["action"] == "stop" and event["payload"]["gpus"] == [0]
    assert event["payload"]["idle_s"] >= 1
    assert nothing_left(gpuflow_home)


def test_idle_gpus_with_action_warn_only_warn(prefect_api, gpuflow_home, fake_nvml):
    from tests.e2e.helpers import events_named, logs_of

    fake_nvml.config["util"] = 0
    state, run_id = run_pipeline(
        _idle_spec([sys.executable, "-c", "import time; time.sleep(2)"], "warn")
    )
    assert state.is_completed(), state.message
    assert any("the job goes on (action: warn)" in line for line in logs_of(run_id))
    [event] = events_named("gpuflow.gpu.idle", f"gpuflow.run.{run_id}")
    assert event["payload"]["action"] == "warn" and event["payload"]["job"] == "idler"


def _memory_cgroups_here() -> bool:
    from gpuflow.tasks.backends.local import cgroups

    probe = cgroups.limit_memory(f"gpuflow-probe-{time.time_ns()}", None, 1 << 30)
    if probe is None:
        return False
    Path(probe).rmdir()
    return True


def test_the_oom_killer_in_the_jobs_memory_cgroup_is_named(prefect_api, gpuflow_home):
    """resources.memory holds the job to 100 MiB in a memory cgroup; the job takes 400 MiB,
    the kernel's OOM killer ends it, and the run says so from the cgroup's own count."""
    if not _memory_cgroups_here():
        pytest.skip("this machine lets no memory cgroup be made (no memory controller)")
    raw = {
        "job": {"kind": "command", "command": [sys.executable, "-c", "x = bytearray(400 << 20)"]},
        "resources": {"memory": "100Mi"},
    }
    state, _ = run_pipeline(raw)
    assert state.is_failed()
    assert "the kernel's out-of-memory killer stopped the job (1 kill(s) in its memory cgroup)" in (
        state.message
    )
    assert nothing_left(gpuflow_home)


ESCAPES_AND_FLOODS = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores the polite stop
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)  # leaves the job's session and group
open(sys.argv[1], "w").write(str(child.pid))
while True:
    print("x" * 200, flush=True)  # floods stdout
"""


def test_an_idle_job_that_ignores_sigterm_escapes_and_floods_is_still_stopped(
    prefect_api, gpuflow_home, fake_nvml, tmp_path
):
    fake_nvml.config["util"] = 0
    pidfile = tmp_path / "escaped.pid"
    raw = _idle_spec([sys.executable, "-c", ESCAPES_AND_FLOODS, str(pidfile)], "stop")
    raw["limits"] |= {"stop_grace_s": 1}
    state, _ = run_pipeline(raw)
    assert state.is_failed()
    assert "the job was stopped because its GPUs (0) were under 5% busy" in state.message
    assert process_gone(int(pidfile.read_text()))
    assert nothing_left(gpuflow_home)


@pytest.fixture
def full_disks(tmp_path):
    """Two tiny tmpfs folders (512 KiB): a disk that fills up, as a real one does."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounts = []
    for name in ("workspaces", "artifacts"):
        folder = tmp_path / name
        folder.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], check=True
        )
        mounts.append(folder)
    yield mounts
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_workspace_or_artifacts_disk_is_named_not_a_traceback(
    prefect_api, gpuflow_home, full_disks
):
    """The job fills its workspace: the sampler keeps going and the failure says the disk
    filled up; the job's output does not fit the artifacts disk: collect says which folder
    and that the job itself completed. Nothing is left either way."""
    workspaces, artifacts = full_disks
    filler = 'head -c 2000000 /dev/zero > "$GPUFLOW_OUTPUT_DIR/big.bin"'
    raw = {
        "name": "fills",
        "job": {"kind": "command", "command": ["sh", "-c", filler]},
        "placement": {"workspace_root": str(workspaces)},
        "resources": {"disk": "100KB"},  # what it says it needs: less than it writes
        "metrics": {"interval_s": 0.1},
    }
    state, _ = run_pipeline(raw)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, JobFailed), error
    assert "the disk filled up" in str(error), str(error)
    assert "Traceback" not in str(error)
    assert nothing_left(gpuflow_home)
    half = 'head -c 400000 /dev/zero > "$GPUFLOW_OUTPUT_DIR/half.bin"'
    raw = {
        "name": "fills-artifacts",
        "job": {"kind": "command", "command": ["sh", "-c", half]},
        "storage": {"artifacts": f"file://{artifacts}"},
    }
    (artifacts / "taken.bin").write_bytes(b"x" * 300_000)
    state, _ = run_pipeline(raw)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, CollectError), error
    assert f"could not be written to {artifacts}" in str(error)
    assert "No space left on device" in str(error) and "ended with exit code 0" in str(error)
    assert nothing_left(gpuflow_home)


def test_a_run_started_here_sends_one_heartbeat_that_stops_with_it(prefect_api, gpuflow_home):
    """`gpuflow run` hands the flow run's heartbeat from Prefect's engine (joined up to a
    second late) to gpuflow's own: the run sends it once at its start, from one sender, not
    two, and no heartbeat thread outlives the run."""
    import threading

    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from gpuflow.tasks.pipeline.heartbeat import THREAD_NAME, heartbeats_sent_by_gpuflow
    from tests.e2e.helpers import events_named

    raw = {"name": "beat", "job": {"kind": "command", "command": ["true"]}}
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 45}), heartbeats_sent_by_gpuflow():
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None  # Prefect's is off
        state, run_id = run_pipeline(raw)
    assert state.is_completed(), state.message
    assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is not None  # and back after the run
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    # a heartbeat goes out before the first task's events: once one is stored, so is it
    assert events_named("prefect.task-run.Completed", f"prefect.flow-run.{run_id}")
    beats = events_named("prefect.flow-run.heartbeat", f"prefect.flow-run.{run_id}")
    assert len(beats) == 1, beats
    related = {r["prefect.resource.role"] for r in beats[0]["related"]}
    assert "flow" in related


def test_a_run_started_by_prefect_keeps_prefects_heartbeat(prefect_api, gpuflow_home):
    """A flow run not started through gpuflow's commands (a worker, a direct call) keeps
    the engine's heartbeat, and gpuflow sends none of its own."""
    from tests.e2e.helpers import events_named

    state, run_id = run_pipeline({"name": "beat", "job": {"kind": "command", "command": ["true"]}})
    assert state.is_completed(), state.message
    assert events_named("prefect.task-run.Completed", f"prefect.flow-run.{run_id}")
    assert len(events_named("prefect.flow-run.heartbeat", f"prefect.flow-run.{run_id}")) == 1
