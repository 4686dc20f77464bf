"""The `gpuflow` command as users run it: exit codes, bad input, cancellation, the reaper."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuflow.tasks.backends.local import gpu_slots
from tests.conftest import subprocess_env
from tests.e2e.helpers import NOTHING_LEFT, flow_run, leftovers, nothing_left, process_gone
from tests.test_spec import BOMB

pytestmark = pytest.mark.e2e
GPUFLOW = [sys.executable, "-m", "gpuflow"]


def gpuflow(args, env, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GPUFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_help_documents_exit_codes():
    out = gpuflow(["--help"], None)
    assert out.returncode == 0
    assert "0 completed; 1 the job or its preflight failed; 2 invalid input" in out.stdout
    for command in ("run", "demo", "preflight", "reap", "ls", "logs", "cancel"):
        assert command in out.stdout
    # the parser and its commands load no Prefect: `gpuflow --help` and a typo are quick
    bare = "import sys, gpuflow.cli; gpuflow.cli.build_parser(); print('prefect' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True)
    assert loaded.stdout.strip() == "False", loaded.stderr[-2000:]


BAD_JOBS = {
    "gpus -1": (
        "job: {kind: command, command: [true]}\nresources: {gpus: -1}\n",
        "resources.gpus must be at least 0",
    ),
    "unknown key": ("job: {kind: command, command: [true]}\nextra: 1\n", "extra: unknown field"),
    "not a mapping": ("- 1\n- 2\n", "top level must be a mapping"),
    "command not found": (
        "job: {kind: command, command: [no-such-prog-42]}\n",
        "'no-such-prog-42' was not found",
    ),
    "missing command": ("job: {kind: command}\n", "job.command is required"),
    "unknown kind": ("job: {kind: bake}\n", "job.kind: 'bake' is not a job kind"),
    "full disk": (
        "job: {kind: command, command: [true]}\nresources: {disk: 900Ti}\n",
        "free but resources.disk asks for",
    ),
    "unwritable workspace": (
        "job: {kind: command, command: [true]}\nplacement: {workspace_root: /proc/ws}\n",
        "placement.workspace_root: cannot write to /proc/ws",
    ),
    "gpu job, no gpu": (
        "job: {kind: command, command: [true]}\nresources: {gpus: 1}\n",
        "this host cannot give 1 GPU",
    ),
    "artifacts under /proc": (
        "job: {kind: command, command: [true]}\nstorage: {artifacts: 'file:///proc/x'}\n",
        "storage.artifacts: cannot write to file:///proc/x",
    ),
    "artifacts is a file": (
        "job: {kind: command, command: [true]}\nstorage: {artifacts: 'file:///etc/hostname'}\n",
        "storage.artifacts: cannot write to file:///etc/hostname",
    ),
    "duplicate key": (
        "job: {kind: command, command: [true]}\nresources: {gpus: 0}\nresources: {gpus: 1}\n",
        "the key 'resources' appears twice (lines 2 and 3)",
    ),
    "render to S3 without credentials": (
        "job: {kind: render, scene: /tmp/x.blend, output: 's3://no-creds-bucket/frames'}\n",
        "no AWS credentials were found for s3://no-creds-bucket/frames",
    ),
}


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_bad_input_exits_2_with_one_sentence_and_provisions_nothing(
    case, tmp_path, prefect_api, gpuflow_home
):
    text, expected = BAD_JOBS[case]
    env = subprocess_env(prefect_api, gpuflow_home)
    env["FAKE_NVML_MODE"] = "missing"
    env["PYTHONPATH"] = str(Path(__file__).parent.parent / "fakes")
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        env.pop(name, None)
    out = gpuflow(["run", str(write(tmp_path, text))], env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expected in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    error_lines = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert len(error_lines) == 1
    assert not (gpuflow_home / "workspaces").exists() or not any(
        (gpuflow_home / "workspaces").iterdir()
    )
    assert not (gpuflow_home / "local" / "clusters").exists()


def no_api_env(gpuflow_home: Path) -> dict[str, str]:
    """An API nobody listens on: a command that needs none must not notice."""
    return subprocess_env("http://127.0.0.1:9/api", gpuflow_home)


def one_sentence(out: subprocess.CompletedProcess, expected: str) -> None:
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert expected in line, line


def test_unreadable_spec_files_are_named_by_every_command(tmp_path, gpuflow_home):
    env = no_api_env(gpuflow_home)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(Path(sys.executable).read_bytes()[:4096])
    deep = tmp_path / "deep.yaml"
    deep.write_text("job: " + "[" * 5000 + "]" * 5000 + "\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("job: {kind: command, command: [true\n")
    for command in (["run"], ["preflight"]):
        one_sentence(gpuflow([*command, str(binary)], env), "is not a text file (not UTF-8)")
        one_sentence(gpuflow([*command, str(deep)], env), "nested too deeply")
        one_sentence(gpuflow([*command, str(tmp_path)], env), "is a folder")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    one_sentence(gpuflow(["run", str(bomb)], env), "its aliases (*name) expand to more than")
    for path, expected in (
        (broken, "not valid YAML at line"),
        (binary, "is not a text file"),
        (bomb, "its aliases (*name) expand to more than"),
    ):
        out = gpuflow(["submit", "command/command-local", f"--param=spec=@{path}"], env)
        one_sentence(out, f"--param spec: {path}: {expected}")


NUMBERS_OUT_OF_RANGE = {
    "offers --top 0": (["offers", "x.yaml", "--top", "0"], "--top: 0 is out of range"),
    "platform --port 99999": (["platform", "up", "--port", "99999"], "--port: 99999 is out"),
    "hpc --ranks abc": (["hpc", "--ranks", "abc"], "--ranks: invalid int value: 'abc'"),
    "hpc --temperature inf": (["hpc", "--temperature", "inf"], "job.md.temperature: inf is out"),
    "render --samples -1": (["render", "s", "--out", "file:///o", "--samples", "-1"], "-1 is out"),
    "reclaim --below-pct 101": (
        ["reclaim", "--prometheus", "http://x", "--below-pct", "101"],
        "--below-pct: 101 is out of range; give from 0 to 100",
    ),
    "submit --timeout nan": (["submit", "a/b", "--timeout", "nan"], "--timeout: nan is out"),
    "hpc --mpijob ''": (["hpc", "--mpijob", ""], "--mpijob: the image is empty"),
    "hpc --mpijob 'UPPER CASE:bad tag'": (
        ["hpc", "--mpijob", "UPPER CASE:bad tag"],
        "--mpijob: 'UPPER CASE:bad tag' has a space in it; an image reference has none.",
    ),
    "hpc --mpijob Registry/Job": (
        ["hpc", "--mpijob", "Registry/Job"],
        "--mpijob: 'Registry/Job' is not an image reference (its path must be lower case:"
        " 'registry/job'?); write [host[:port]/]path[:tag][@digest], e.g. ghcr.io/team/train:1.4.",
    ),
}


@pytest.mark.parametrize("case", list(NUMBERS_OUT_OF_RANGE))
def test_numeric_options_out_of_range_are_refused(case, gpuflow_home):
    argv, expected = NUMBERS_OUT_OF_RANGE[case]
    out = gpuflow(argv, no_api_env(gpuflow_home))
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "Traceback" not in out.stderr
    assert not (gpuflow_home / "workspaces").exists()


TUNING = {
    "start timeout abc": ("GPUFLOW_API_START_TIMEOUT_S", "abc", "from 1 to 3600"),
    "start timeout -3": ("GPUFLOW_API_START_TIMEOUT_S", "-3", "from 1 to 3600"),
    "start timeout nan": ("GPUFLOW_API_START_TIMEOUT_S", "nan", "from 1 to 3600"),
    "start timeout 1e9": ("GPUFLOW_API_START_TIMEOUT_S", "1e9", "from 1 to 3600"),
    "outage -1": ("GPUFLOW_API_OUTAGE_S", "-1", "from 1 to 604800"),
    "idle x": ("GPUFLOW_API_IDLE_S", "x", "from 0 to 604800"),
}


@pytest.mark.parametrize("case", list(TUNING))
def test_a_tuning_variable_that_is_no_number_is_named(case, tmp_path, gpuflow_home):
    """Refused before any server starts: nothing is left running for a typo."""
    name, value, bounds = TUNING[case]
    env = subprocess_env(None, gpuflow_home) | {name: value}
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    out = gpuflow(["run", str(write(tmp_path, "job: {kind: command, command: [true]}\n"))], env)
    one_sentence(out, f"{name}: {value!r} is not a number {bounds}")
    assert "starting a temporary Prefect API" not in out.stderr
    assert not (gpuflow_home / "servers").exists()


def test_reap_kubernetes_without_a_usable_kubeconfig_says_so(tmp_path, prefect_api, gpuflow_home):
    env = subprocess_env(prefect_api, gpuflow_home) | {"HOME": str(tmp_path)}
    broken = tmp_path / "broken-kubeconfig"
    broken.write_text("clusters: [\n")
    listed = tmp_path / "listed-kubeconfig"
    listed.write_text("- a\n- b\n")
    for kubeconfig, expected in (
        (tmp_path / "none", "no Kubernetes credentials were found"),
        (broken, f"{broken}: not valid YAML at line 2"),
        (listed, f"{listed}: is not a kubeconfig"),
    ):
        out = gpuflow(["reap", "--backend", "kubernetes"], env | {"KUBECONFIG": str(kubeconfig)})
        one_sentence(out, expected)
        assert "InvalidSpec" not in out.stderr


PREPARE_TYPOS = {
    "shard size not a size": (["--shard-size", "abc"], "shard_size: 'abc' is not a size"),
    "shard size 0": (["--shard-size", "0"], "shard_size must be at least 4 KiB"),
    "output not storage": (["--output", "http://x"], "output: 'http://x' is not a storage URL"),
    "s3 without bucket": (["--output", "s3://"], "output: 's3://' names no bucket"),
    "negative samples": (
        ["--source", "synthetic:classify?samples=-5"],
        "samples=-5 in 'synthetic:classify?samples=-5' is out of range; give 1 to",
    ),
    "image too large": (
        ["--source", "synthetic:classify?image_size=9999999"],
        "image_size=9999999 in 'synthetic:classify?image_size=9999999' is out of range",
    ),
    "missing folder": (["--source", "/no/such/folder"], "'/no/such/folder' is not a folder"),
}


@pytest.mark.parametrize("case", list(PREPARE_TYPOS))
def test_prepare_dataset_typos_fail_at_once_without_any_api(case, tmp_path, gpuflow_home):
    change, expected = PREPARE_TYPOS[case]
    args = {"--source": "synthetic:classify?samples=8", "--output": f"file://{tmp_path}/d"}
    args |= {"--shard-size": "1MB"}
    args |= dict(zip(change[::2], change[1::2], strict=True))
    argv = ["prepare-dataset", args["--source"], args["--output"], "--shard-size"]
    out = gpuflow([*argv, args["--shard-size"]], no_api_env(gpuflow_home))
    one_sentence(out, expected)
    assert "PREFECT_API_URL" not in out.stderr  # it never needed the API


def test_run_completes_and_failing_job_exits_1(tmp_path, prefect_api, gpuflow_home):
    env = subprocess_env(prefect_api, gpuflow_home)
    ok = gpuflow(
        [
            "run",
            str(
                write(tmp_path, "name: hello\njob: {kind: command, command: [echo, hello-there]}\n")
            ),
        ],
        env,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "hello: completed" in ok.stdout and "artifacts:" in ok.stdout
    assert f"[gpuflow] using the Prefect API at {prefect_api} (PREFECT_API_URL)" in ok.stderr
    ui = prefect_api.removesuffix("/api")
    assert f"  flow run: {ui}/runs/flow-run/" in ok.stdout
    failing = "job: {kind: command, command: [sh, -c, 'echo my own last line; exit 4']}\n"
    bad = gpuflow(["run", str(write(tmp_path, failing))], env)
    assert bad.returncode == 1
    # The job's own line and gpuflow's sentence; Prefect's traceback of gpuflow's code
    # stays in the run's log on the server.
    assert "my own last line" in bad.stdout + bad.stderr
    assert "gpuflow: failed: the job exited with code 4" in bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr
    assert nothing_left(gpuflow_home)


def test_preflight_command(tmp_path, gpuflow_home):
    env = subprocess_env("http://127.0.0.1:9/api", gpuflow_home, fake_gpus=0)
    env["FAKE_NVML_MODE"] = "missing"
    out = gpuflow(["preflight"], env)
    assert (
        out.returncode == 0 and "continuing on CPU" in out.stdout and "verdict: warn" in out.stdout
    )
    strict = write(tmp_path, "job: {kind: command, command: [true]}\nresources: {gpus: 1}\n")
    out = gpuflow(["preflight", str(strict)], env)
    assert out.returncode == 1 and "no NVIDIA driver is installed" in out.stdout
    env.pop("FAKE_NVML_MODE")
    env["FAKE_NVML_GPUS"] = "2"
    out = gpuflow(["preflight", str(strict), "--json"], env)
    assert out.returncode == 0, out.stdout
    report = json.loads(out.stdout)
    levels = {c["name"]: c["level"] for c in report["checks"]}
    assert levels["gpus"] == "pass" and report["gpus_reserved"] == [0]
    assert report["verdict"] == ("warn" if levels.get("nvidia-smi") == "warn" else "pass")
    missing = write(tmp_path, "job: {kind: command, command: [no-such-program-x, --go]}\n")
    out = gpuflow(["preflight", str(missing)], env)
    assert out.returncode == 1 and "verdict: fail" in out.stdout
    assert "[fail] program: job.command: 'no-such-program-x' was not found here" in out.stdout


# what a job wrote before it was stopped: written before its pid, so it is there when the
# test stops the run
SAVED = 'echo step-90 > "$GPUFLOW_OUTPUT_DIR/checkpoint.txt"'


def _start_long_run(
    tmp_path, prefect_api, gpuflow_home, script="exec sleep 300", extra="", first="true"
):
    pidfile = tmp_path / "job.pid"
    job = write(
        tmp_path,
        f"name: long\njob: {{kind: command, command: [sh, -c, '{first}; echo $$ > {pidfile}; {script}']}}\n"
        f"resources: {{gpus: 1}}\n{extra}",
    )
    env = subprocess_env(prefect_api, gpuflow_home, fake_gpus=2)
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)
    return proc, int(pidfile.read_text()), env


def _flow_run_id(gpuflow_home: Path) -> str:
    (record,) = (gpuflow_home / "local" / "clusters").glob("*.json")
    return record.stem.removeprefix("gpuflow-")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupting_a_run_tears_everything_down(
    sig, tmp_path, prefect_api, gpuflow_home, gpu_limit
):
    proc, job_pid, _ = _start_long_run(tmp_path, prefect_api, gpuflow_home, first=SAVED)
    run_id = _flow_run_id(gpuflow_home)
    assert gpu_slots.slots_in_use() == 1
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out
    (kept,) = (gpuflow_home / "runs").glob("long-*/outputs/checkpoint.txt")  # kept, and said
    assert kept.read_text() == "step-90\n" and "the job's outputs were kept: 1 file(s)" in out
    (sentence,) = [line for line in out.splitlines() if line.startswith("gpuflow:")]
    assert sentence.startswith(f"gpuflow: stopped by {signal.Signals(sig).name}")
    assert process_gone(job_pid), out[-3000:]
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert gpu_slots.slots_in_use() == 0
    assert flow_run(run_id).state.is_crashed()


def test_a_second_signal_does_not_cut_the_stop_short(
    tmp_path, prefect_api, gpuflow_home, gpu_limit
):
    """Ctrl-C, then SIGTERM while the job saves its state: the job gets SIGTERM once and
    its whole limits.stop_grace_s, the command says it is already stopping and exits 130."""
    notes = tmp_path / "notes"
    script = (
        f'trap "echo term >> {notes}; sleep 3; echo saved >> {notes}; exit 0" TERM;'
        " while :; do sleep 0.2; done"
    )
    proc, job_pid, _ = _start_long_run(
        tmp_path, prefect_api, gpuflow_home, script, "limits: {stop_grace_s: 20}\n"
    )
    run_id = _flow_run_id(gpuflow_home)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while not (notes.exists() and "term" in notes.read_text()):
        assert time.monotonic() < deadline, "the job never got SIGTERM"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert notes.read_text().split() == ["term", "saved"], out[-3000:]
    assert "already stopping" in out and "Traceback" not in out
    assert process_gone(job_pid)
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert flow_run(run_id).state.is_crashed()


def test_reaper_cleans_up_after_a_killed_orchestrator(
    tmp_path, prefect_api, gpuflow_home, gpu_limit
):
    proc, job_pid, env = _start_long_run(tmp_path, prefect_api, gpuflow_home)
    run_id = _flow_run_id(gpuflow_home)
    # A record write cut short by a SIGKILL leaves its temporary file behind.
    half_written = gpuflow_home / "local" / "clusters" / f".gpuflow-{run_id}.json.{proc.pid}.tmp"
    half_written.write_text('{"cluster": ')
    proc.kill()  # SIGKILL: no finally, no hooks
    proc.wait(timeout=30)
    assert not process_gone(job_pid)  # the job survived its orchestrator
    assert gpu_slots.slots_in_use() == 1
    dry = gpuflow(["reap", "--dry-run"], env)
    assert "would reap" in dry.stdout and not process_gone(job_pid)
    out = gpuflow(["reap"], env)
    assert out.returncode == 0 and "1 leftover cluster(s)" in out.stdout
    # The planted file is one; the sweep of this user's SSH key folders whose process died
    # (machine-wide: another killed gpuflow's count too) adds the rest.
    removed = [line for line in out.stdout.splitlines() if line.startswith("removed ")]
    assert f"removed {half_written} (half-written by a process that died)" in removed
    assert f"1 flow run(s) marked Crashed, {len(removed)} half-written file(s)" in out.stdout
    deadline = time.monotonic() + 15
    while not process_gone(job_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(job_pid)
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert not half_written.exists()
    assert gpu_slots.slots_in_use() == 0
    assert flow_run(run_id).state.is_crashed()


def test_cancelling_in_the_api_stops_the_job_and_cleans_up(
    tmp_path, prefect_api, gpuflow_home, gpu_limit
):
    """What the UI's Cancel button does to a run started with `gpuflow run` (no worker)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    proc, job_pid, _ = _start_long_run(tmp_path, prefect_api, gpuflow_home, first=SAVED)
    run_id = _flow_run_id(gpuflow_home)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    assert "gpuflow: cancelled" in out
    # what the job wrote before the cancel is in the run's artifacts, and the summary says so
    (kept,) = (gpuflow_home / "runs").glob("long-*/outputs/checkpoint.txt")
    assert kept.read_text() == "step-90\n"
    assert f"what it wrote is in {kept.parent.parent}" in out, out[-3000:]
    assert json.loads((kept.parent.parent / "metrics.json").read_text())["duration_s"] > 0
    assert process_gone(job_pid)
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert gpu_slots.slots_in_use() == 0
    assert flow_run(run_id).state.is_cancelled()


def test_unreachable_api_is_one_sentence(tmp_path, gpuflow_home):
    env = subprocess_env("http://127.0.0.1:9/api", gpuflow_home)
    job = write(
        tmp_path, "job: {kind: command, command: [true]}\nsecret_env: {TOKEN: some-block}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "gpuflow: the Prefect API at http://127.0.0.1:9/api (PREFECT_API_URL) is unreachable:"
        " the connection was refused (no server listens there); start that server, or unset"
        " PREFECT_API_URL to use the local platform or a temporary API."
    )


def test_a_silent_api_is_named_as_silent(tmp_path, gpuflow_home):
    """A server that takes the connection and never answers (a hung or overloaded one)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        job = write(tmp_path, "job: {kind: command, command: [true]}\n")
        out = gpuflow(["run", str(job)], subprocess_env(url, gpuflow_home))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"gpuflow: the Prefect API at {url} (PREFECT_API_URL) is unreachable: it did not"
        " answer within 10 s; start that server, or unset PREFECT_API_URL to use the local"
        " platform or a temporary API."
    )
    assert nothing_left(gpuflow_home)


def test_a_temporary_api_that_cannot_start_is_named_with_its_cause(tmp_path, gpuflow_home):
    home = tmp_path / "prefect-home"
    env = subprocess_env("", gpuflow_home)
    env.pop("PREFECT_API_URL")
    env["PREFECT_HOME"] = str(home)
    # a database in a folder that is not there: the server itself fails to open it
    database = tmp_path / "no-such-folder" / "prefect.db"
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{database}"
    out = gpuflow(["run", str(write(tmp_path, "job: {kind: command, command: [true]}\n"))], env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (sentence,) = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert sentence.startswith(
        "gpuflow: the temporary Prefect API could not start: sqlalchemy.exc.OperationalError:"
        " (sqlite3.OperationalError) unable to open database file (its database is under"
        f" PREFECT_HOME={home}); see "
    ), sentence
    # PREFECT_HOME a file: refused before any server starts on it
    home = tmp_path / "prefect-home-file"
    home.write_text("a file where PREFECT_HOME should be")
    env["PREFECT_HOME"] = str(home)
    del env["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    out = gpuflow(["run", str(write(tmp_path, "job: {kind: command, command: [true]}\n"))], env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().endswith(
        f"gpuflow: PREFECT_HOME {home} is not a folder; point PREFECT_HOME at a folder of your"
        " own, or unset it (~/.prefect)."
    ), out.stderr
    kept = [p.suffix for p in (gpuflow_home / "servers").iterdir() if p.name != "auth"]
    assert kept == [".log"]  # named, kept
    assert nothing_left(gpuflow_home)


def test_submit_and_deploy_need_a_lasting_server(gpuflow_home):
    env = subprocess_env("", gpuflow_home)
    env.pop("PREFECT_API_URL")
    for argv in (["submit", "command/command-local"], ["deploy", "--pool", "gpuflow-local"]):
        out = gpuflow(argv, env)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.strip().endswith(
            "neither PREFECT_API_URL is set nor the local platform running; set"
            " PREFECT_API_URL or run `gpuflow platform up`."
        ), out.stderr
    assert not (gpuflow_home / "servers").exists()  # no temporary API was started


def test_demo_runs_the_smoke_job(prefect_api, gpuflow_home):
    """The README's first command ends in `gpuflow demo`."""
    env = subprocess_env(prefect_api, gpuflow_home)
    out = gpuflow(["demo"], env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "smoke: completed" in out.stdout and "TFLOP/s on" in out.stdout
    artifacts = Path(out.stdout.split("artifacts: ")[1].split()[0])
    assert (artifacts / "outputs" / "result.json").is_file()
    assert nothing_left(gpuflow_home)


def test_ls_logs_follow_and_cancel_follow_a_run_from_another_terminal(
    tmp_path, prefect_api, gpuflow_home, gpu_limit
):
    """While `gpuflow run` runs a job: `ls` lists it Running on local with its GPU,
    `logs --follow` prints its lines as they come and ends when the run does, and
    `cancel` (by the first characters of its id) stops the job and tears it down, as the
    UI's Cancel does; a run that is over, or none, is one sentence."""
    script = "for i in 1 2 3; do echo tick $i; sleep 0.3; done; exec sleep 300"
    proc, job_pid, env = _start_long_run(tmp_path, prefect_api, gpuflow_home, script)
    run_id = _flow_run_id(gpuflow_home)
    listed = gpuflow(["ls"], env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    header, *rows = listed.stdout.splitlines()
    assert header.split() == [
        "RUN",
        "JOB",
        "STATE",
        "BACKEND",
        "HOST",
        "GPUS",
        "DURATION",
        "COST",
        "FLOW",
        "RUN",
    ]
    [row] = [r.split() for r in rows if run_id.startswith(r.split()[0])]
    assert row[1:6] == ["long", "Running", "local", "-", "1"]  # the host: once collected
    # the id it shows (8 characters, more when a recent run shares them) resolves
    assert len(row[0]) >= 8 and not [r for r in rows if r.split()[0] == row[0] and r.split() != row]
    following = subprocess.Popen(
        [*GPUFLOW, "logs", "long", "--follow"], env=env, stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    seen: list[str] = []
    while not any("tick 3" in line for line in seen):  # printed as the job prints it
        assert time.monotonic() < deadline, seen
        seen.append(following.stdout.readline())
    # Ctrl-C on a second `logs --follow`: that command ends, saying the run goes on
    interrupted = subprocess.Popen(
        [*GPUFLOW, "logs", "long", "--follow"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while "tick 1" not in interrupted.stdout.readline():
        assert time.monotonic() < deadline + 60 and interrupted.poll() is None
    interrupted.send_signal(signal.SIGINT)
    _, said = interrupted.communicate(timeout=60)
    assert interrupted.returncode == 130 and said.strip().endswith(
        "gpuflow: stopped by SIGINT (Ctrl-C): only this command stopped; the run goes on"
        " (`gpuflow cancel RUN` stops it)."
    ), said
    assert flow_run(run_id).state.is_running()
    cancelled = gpuflow(["cancel", row[0]], env)
    assert cancelled.returncode == 0, cancelled.stderr[-2000:]
    assert cancelled.stdout.strip().endswith("is cancelled: its job was stopped and torn down.")
    rest, _ = following.communicate(timeout=60)  # the run is over: so is --follow
    assert following.returncode == 0 and "Finished in state Cancelled" in rest
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "gpuflow: cancelled" in out
    assert process_gone(job_pid)
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    assert flow_run(run_id).state.is_cancelled()
    again = gpuflow(["cancel", "long"], env)
    assert again.returncode == 2
    assert f"RUN: long ({flow_run(run_id).name}, {run_id[:8]}) is already cancelled" in again.stderr
    logs = gpuflow(["logs", run_id], env)
    assert logs.returncode == 0 and "tick 1" in logs.stdout and "tick 3" in logs.stdout
    for name in ("no-such-run", "zz"):
        missing = gpuflow(["logs", name], env)
        assert missing.returncode == 2
        assert f"gpuflow: invalid input: RUN: no run is named '{name}' among the" in missing.stderr


def test_a_prefix_that_begins_two_runs_ids_is_named_with_both(prefect_api, gpuflow_home):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="placeholder")
    def placeholder() -> None:
        pass

    ids: list[str] = []
    with get_client(sync_client=True) as client:
        while len({i[0] for i in ids}) == len(ids):  # 17 at most: two share a first digit
            ids.append(str(client.create_flow_run(placeholder).id))
    first = next(c for c in "0123456789abcdef" if sum(i[0] == c for i in ids) > 1)
    out = gpuflow(["logs", first], subprocess_env(prefect_api, gpuflow_home))
    assert out.returncode == 2
    assert f"gpuflow: invalid input: RUN: '{first}' begins the ids of" in out.stderr
    assert "give more of the id (gpuflow ls shows them)." in out.stderr


def test_a_run_outlives_a_closed_pipe_and_a_closed_terminal(tmp_path, prefect_api, gpuflow_home):
    """`gpuflow run JOB | head -1`: the reader goes after one line and the run goes on to
    its end, its log whole in the API; so does a run whose terminal hangs up (SIGHUP,
    then EIO on every write)."""
    import os
    import pty

    job = write(
        tmp_path,
        "name: outlive\njob: {kind: command, command: [sh, -c, 'for i in $(seq 1 40); do echo"
        " line $i; sleep 0.05; done; echo the last line']}\n",
    )
    env = subprocess_env(prefect_api, gpuflow_home)
    piped = subprocess.run(
        ["sh", "-c", f"{sys.executable} -m gpuflow run {job} 2>&1 | head -1"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert len(piped.stdout.splitlines()) == 1
    from tests.e2e.helpers import logs_of

    def last_run() -> Any:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            return client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]

    deadline = time.monotonic() + 120
    while not (run := last_run()).state.is_final():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert run.state.is_completed(), run.state.message
    assert "the last line" in "\n".join(logs_of(run.id))
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(job)], env=env, stdin=secondary, stdout=secondary,
        stderr=secondary, start_new_session=True,
    )  # fmt: skip
    os.close(secondary)
    seen = b""
    while b"line 3" not in seen:
        seen += os.read(primary, 4096)
    os.close(primary)  # the terminal goes: writes fail from now on
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=180) == 0
    run = last_run()
    assert run.state.is_completed(), run.state.message
    assert "the last line" in "\n".join(logs_of(run.id))
