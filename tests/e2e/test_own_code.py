"""A user's own code on this machine through gpu_pipeline: the working folder sent with
its excludes and started in, setup once, ${NAME} from the unit's environment, the same
files on a retried attempt whatever the folder holds by then, resume_args, torchrun with
two ranks (an all-reduce, SIGTERM -> checkpoint -> 75 -> resumed), and the figures a
script prints made the run's metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import artifacts_of, logs_of, nothing_left

pytestmark = pytest.mark.e2e
PROJECT = Path(__file__).resolve().parents[1] / "fixtures" / "owncode"
LOSS = r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+)"


def project(tmp_path: Path) -> Path:
    """Return a copy of the user's project, with files its .gitignore leaves out."""
    folder = tmp_path / "project"
    shutil.copytree(PROJECT, folder)
    (folder / "scratch").mkdir()
    (folder / "scratch" / "big.bin").write_bytes(b"\0" * 4096)
    (folder / "run.log").write_text("a log of an earlier run\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return folder


def test_the_readme_example_runs_in_its_working_folder_with_setup_and_its_figures(
    prefect_api, gpuflow_home, tmp_path
):
    """The spec file names its folder relative to itself; the job starts in a copy of it
    without what .gitignore excludes (nor .git), after its setup command, with
    ${GPUFLOW_OUTPUT_DIR} expanded on the node; its loss lines are the run's figures:
    table, plot, summary and metrics.json."""
    project(tmp_path)
    spec_file = tmp_path / "jobs" / "train.yaml"
    spec_file.parent.mkdir()
    spec_file.write_text(
        "name: own-train\n"
        "job:\n"
        "  kind: command\n"
        "  command: [python, train.py, --epochs, 3, --out, '${GPUFLOW_OUTPUT_DIR}/model.json']\n"
        "  workdir: ../project\n"
        "  setup: ['echo set up in $(basename $PWD) > setup.txt']\n"
        "resources: {gpus: 0, allow_cpu: true}\n"
        f"metrics: {{from_log: ['{LOSS}']}}\n"
    )
    state = gpu_pipeline(load_spec(spec_file), return_state=True)
    assert state.is_completed(), state.message
    result, run_id = state.result(), state.state_details.flow_run_id
    logs = "\n".join(logs_of(run_id))
    assert "epoch 2 loss 0.8333" in logs
    [files] = [line for line in logs.splitlines() if line.startswith("files here:")]
    assert files == "files here: .gitignore,data,ddp.py,setup.txt,train.py"  # no .git, log, scratch
    assert "job.workdir: 4 files" in logs
    out = Path(result.artifacts_dir)
    assert json.loads((out / "outputs" / "model.json").read_text())["epochs"] == 3
    assert result.metrics.from_log == {"epoch": 2.0, "loss": 0.8333}
    assert result.metrics.from_log_rows == 3
    rows = [json.loads(line) for line in (out / "log_metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["loss"]) for r in rows] == [(0, 2.5), (1, 1.25), (2, 0.8333)]
    assert (out / "log_metrics.png").stat().st_size > 1000
    artifacts = artifacts_of(run_id)
    table = json.loads(artifacts["gpuflow-log-metrics"].data)
    assert [r["loss"] for r in table] == [2.5, 1.25, 0.8333]
    summary = artifacts["gpuflow-summary"].data
    assert "from the job's log (3 rows), last: epoch 2, loss 0.8333" in summary
    assert nothing_left(gpuflow_home)


def test_a_retried_attempt_gets_the_packed_files_and_the_resume_args(
    prefect_api, gpuflow_home, tmp_path
):
    """The first attempt rewrites the folder it came from and says it was preempted
    (exit 75); the retried attempt runs the files packed at the start, with --resume."""
    folder = tmp_path / "project"
    folder.mkdir()
    script = (
        "import sys, pathlib\n"
        "print('version 1', sys.argv[1:], flush=True)\n"
        "if '--resume' not in sys.argv:\n"
        f"    pathlib.Path({str(folder / 'job.py')!r}).write_text('print(\"version 2\")')\n"
        "    sys.exit(75)\n"
    )
    (folder / "job.py").write_text(script)
    raw = {
        "name": "same-files",
        "job": {
            "kind": "command",
            "command": ["python", "job.py", "--steps", "${STEPS}"],
            "workdir": str(folder),
            "resume_args": ["--resume"],
        },
        "env": {"STEPS": "7"},
        "resources": {"gpus": 0, "allow_cpu": True},
        "retry": {"run": {"retries": 1, "delay_s": 0}},
    }
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "version 1 ['--steps', '7']" in logs
    assert "version 1 ['--steps', '7', '--resume']" in logs
    assert "version 2" not in logs
    assert (folder / "job.py").read_text() == 'print("version 2")'  # what the folder holds now


def test_a_failing_setup_command_is_one_sentence_and_the_job_never_starts(
    prefect_api, gpuflow_home, tmp_path
):
    folder = project(tmp_path)
    raw = {
        "name": "bad-setup",
        "job": {
            "kind": "command",
            "command": ["python", "train.py"],
            "workdir": str(folder),
            "setup": ["echo installing", "exit 4", "touch never"],
        },
        "resources": {"gpus": 0, "allow_cpu": True},
        "retry": {"run": {"retries": 0}},
    }
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_failed()
    assert state.message.count("job.setup[1] ('exit 4') exited with 4 on this node") == 1, (
        state.message
    )
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "installing" in logs and "epoch" not in logs


def test_torchrun_starts_two_ranks_that_all_reduce_checkpoint_on_sigterm_and_resume(
    prefect_api, gpuflow_home, tmp_path
):
    """launcher: torchrun with two ranks on this machine (gloo, no GPU): each rank gets
    torchrun's variables and gpuflow's; the all-reduce of rank + 1 over both is 3; a
    SIGTERM to the job's group checkpoints, exits 75, and the retried attempt resumes."""
    pytest.importorskip("torch")
    raw = {
        "name": "ddp-two",
        "job": {
            "kind": "command",
            "command": ["python", "ddp.py"],
            "workdir": str(project(tmp_path)),
            "launcher": "torchrun",
            "ranks_per_node": 2,
            "resume_args": ["--resume"],
        },
        "env": {"PREEMPT_ONCE": "1"},
        "resources": {"gpus": 0, "allow_cpu": True},
        "retry": {"run": {"retries": 1, "delay_s": 0}},
    }
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    outputs = Path(state.result().artifacts_dir) / "outputs"
    ranks = [json.loads((outputs / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for number, seen in enumerate(ranks):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(number)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["GPUFLOW_MASTER_ADDR"] == seen["GPUFLOW_NODE_ADDRS"] == "localhost"
        assert (seen["GPUFLOW_ATTEMPT"], seen["argv"], seen["sum"]) == ("2", ["--resume"], 3.0)
    assert sorted(p.name for p in outputs.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-1"]
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "interrupted and saved its state (exit 75)" in logs
