"""Training end to end: data in a real S3-compatible server, torchrun ranks on the CPU,
checkpoints that survive SIGTERM, and bad inputs refused before anything is provisioned."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch

from gpuflow.flows.datasets import prepare_dataset
from gpuflow.flows.train import train
from gpuflow.tasks.errors import InvalidSpec, JobFailed
from gpuflow.tasks.spec import load_spec
from gpuflow.tasks.storage import FileStore, S3Store
from gpuflow.tasks.training import checkpoint as ckpt
from tests.conftest import save_aws_block
from tests.e2e.helpers import (
    hold_ranks_at,
    logs_of,
    nothing_left,
    release_when_signalled,
    task_runs_of,
)

pytestmark = pytest.mark.e2e
SAMPLES = 256


@pytest.fixture(scope="module")
def s3_dataset(s3_server, prefect_api) -> str:
    """256 synthetic images in 32 shards on the S3 server, packed by the prepare_dataset flow."""
    save_aws_block(s3_server, "gpuflow-test-s3")
    url = s3_server.url("datasets/cnn")
    result = prepare_dataset(
        f"synthetic:classify?samples={SAMPLES}", url, "40KB", "gpuflow-test-s3"
    )
    assert result.shards == 32 and result.samples == SAMPLES
    return url


def train_spec(dataset: str, output: str, **job) -> dict:
    base = {
        "kind": "train",
        "dataset": dataset,
        "output": output,
        "batch_size": 16,
        "num_workers": 1,
        "cpu_processes": 2,
        "log_every": 1,
        "shuffle_buffer": 32,
        "checkpoint": {"every_steps": 5},
    }
    return {
        "name": "cnn",
        "job": base | job,
        "storage": {"aws_credentials": "gpuflow-test-s3"},
        "retry": {"run": {"retries": 2, "delay_s": 0.01}},
    }


def run(raw: dict):
    state = train(load_spec(raw), return_state=True)
    return state, state.state_details.flow_run_id


def test_prepare_dataset_rerun_writes_nothing(s3_dataset, aws_block):
    again = prepare_dataset(f"synthetic:classify?samples={SAMPLES}", s3_dataset, "40KB", aws_block)
    assert again.written == 0 and again.skipped == 32


def _epoch_keys(path: Path, epoch: int) -> list[str]:
    pairs = [line.split("\t") for line in path.read_text().splitlines()]
    return [key for e, key in pairs if int(e) == epoch]


def test_two_rank_ddp_sees_each_sample_once(s3_dataset, s3_server, gpuflow_home, aws_block):
    # 12 steps x 16 samples per rank: past the end of the first epoch on both ranks
    raw = train_spec(s3_dataset, s3_server.url("runs/ddp"), max_steps=12, log_sample_keys=True)
    state, _ = run(raw)
    assert state.is_completed(), state.message
    result = state.result()
    outputs = Path(result.artifacts_dir) / "outputs"
    rank0 = _epoch_keys(outputs / "keys-rank0.txt", 0)
    rank1 = _epoch_keys(outputs / "keys-rank1.txt", 0)
    assert len(set(rank0)) == len(rank0) and len(set(rank1)) == len(rank1)  # once per rank
    assert not set(rank0) & set(rank1)  # disjoint across ranks
    assert len(rank0) + len(rank1) == SAMPLES  # and together the whole epoch
    assert _epoch_keys(outputs / "keys-rank0.txt", 1)  # training went on into epoch 1
    job = result.metrics.job
    lines = sum(len((outputs / f"keys-rank{r}.txt").read_text().splitlines()) for r in (0, 1))
    assert job["world_size"] == 2 and job["steps"] == 12 and job["samples_seen"] == lines
    store = S3Store(s3_server.settings())
    manifest = json.loads(store.read_bytes(job["weights_manifest"]))
    assert manifest["step"] == 12 and manifest["files"]["model.pt"] == store.checksum(
        job["weights"]
    )
    assert (Path(result.artifacts_dir) / "training.png").is_file()
    assert nothing_left(gpuflow_home)
    logs = "\n".join(logs_of(result.flow_run_id))
    assert (
        "step 12/12" in logs and s3_server.secret not in logs
    )  # the S3 secret reached the ranks, not the log


@pytest.mark.parametrize(("eval_every", "evaluated_at"), [(8, [8, 16, 20]), (None, [20])])
def test_eval_runs_on_its_own_schedule_and_at_the_end_and_is_shown(
    eval_every, evaluated_at, s3_dataset, s3_server, gpuflow_home, aws_block
):
    """eval_every 8 with log_every 5: eval at 8, 16 and the last step (20), not only on
    log steps; with no eval_every, once at the end. Loss and top-1 accuracy reach the log,
    the metrics table, the summary, the result and the plot."""
    from prefect.client.orchestration import get_client

    from gpuflow.tasks.training.report import read_metrics

    raw = train_spec(
        s3_dataset,
        s3_server.url(f"runs/eval-{eval_every}"),
        max_steps=20,
        log_every=5,
        cpu_processes=1,
        eval_dataset=s3_dataset,
        eval_every=eval_every,
        eval_batches=2,
    )
    state, run_id = run(raw)
    assert state.is_completed(), state.message
    result = state.result()
    rows = read_metrics(Path(result.artifacts_dir) / "outputs" / "train_metrics.jsonl")
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == evaluated_at
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_loss"] > 0 for r in evals)
    assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20]
    job = result.metrics.job
    assert job["eval_step"] == 20 and job["eval_loss"] == evals[-1]["eval_loss"]
    assert job["eval_accuracy"] == evals[-1]["eval_accuracy"]
    logs = "\n".join(logs_of(run_id))
    for step in evaluated_at:
        assert f"eval at step {step}: loss " in logs and "top-1 accuracy" in logs
    with get_client(sync_client=True) as client:
        table = client.read_latest_artifacts()
    by_key = {a.key: a for a in table if a.flow_run_id == run_id}
    metrics = {row["metric"]: row["value"] for row in json.loads(by_key["gpuflow-metrics"].data)}
    assert metrics["train.eval_accuracy"] == evals[-1]["eval_accuracy"]
    assert metrics["train.eval_step"] == 20
    assert "top-1 accuracy" in by_key["gpuflow-summary"].data
    assert (Path(result.artifacts_dir) / "training.png").is_file()


def _weights(store: S3Store, url: str) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(store.read_bytes(url)), weights_only=True)


def test_resume_after_sigterm_is_exact(s3_dataset, s3_server, gpuflow_home, aws_block, tmp_path):
    """20 steps straight vs 20 steps with a SIGTERM (a spot reclaim) to the job at step 6
    (its ranks held there until it reaches them): same weights, bitwise."""
    store = S3Store(s3_server.settings())
    straight, _ = run(train_spec(s3_dataset, s3_server.url("runs/straight"), max_steps=20))
    assert straight.is_completed(), straight.message

    stopped_at: list[int] = []

    def reclaim() -> None:
        held, step = hold_ranks_at(gpuflow_home / "workspaces", 6, ranks=2, seconds=120)
        stopped_at.append(step)
        try:
            [record] = (gpuflow_home / "local" / "clusters").glob("*.json")
            [job] = json.loads(record.read_text())["jobs"]  # the job's process group
            os.killpg(int(job), signal.SIGTERM)
        finally:
            release_when_signalled(held)

    watcher = threading.Thread(target=reclaim, daemon=True)
    watcher.start()
    resumed, _ = run(train_spec(s3_dataset, s3_server.url("runs/resumed"), max_steps=20))
    watcher.join(timeout=5)
    assert resumed.is_completed(), resumed.message
    run_id = resumed.result().flow_run_id  # the train flow run that ran the stages
    assert stopped_at and 6 <= stopped_at[0] < 20
    run_task = next(t for t in task_runs_of(run_id) if t.name.startswith("run"))
    assert run_task.run_count == 2  # preempted once, retried, resumed
    logs = "\n".join(logs_of(run_id))
    assert "preempted at step" in logs and "resumed from checkpoint step" in logs
    a = _weights(store, straight.result().metrics.job["weights"])
    b = _weights(store, resumed.result().metrics.job["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _corrupt_dataset(tmp_path: Path) -> str:
    from gpuflow.tasks.training.prepare import prepare

    url = f"file://{tmp_path}/corrupt"
    prepare("synthetic:classify?samples=64", url, 20_000, FileStore())
    shard = tmp_path / "corrupt" / "shard-000001.tar"
    members, bad = [], None
    with tarfile.open(shard) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name.endswith(".png") and bad is None:
                data = b"this is not a png"
                key = member.name.split(".")[0]
                first = next(m for m, _ in members if m.name.startswith(key + "."))
                bad = (key, first.offset)  # a sample is reported where it starts in the shard
            members.append((member, data))
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return url, bad


def test_corrupt_sample_skip_or_fail(tmp_path, prefect_api, gpuflow_home):
    url, (key, offset) = _corrupt_dataset(tmp_path)
    base = {
        "cpu_processes": 1,
        "num_workers": 0,
        "max_steps": 4,
        "batch_size": 8,
        "shuffle_buffer": 0,
    }
    raw = train_spec(url, f"file://{tmp_path}/out-skip", **base) | {"storage": {}}
    skipped, _ = run(raw)
    assert skipped.is_completed(), skipped.message
    assert skipped.result().metrics.job["skipped_samples"] == 1
    raw = train_spec(url, f"file://{tmp_path}/out-fail", **base, on_corrupt="fail") | {
        "storage": {}
    }
    failed, _ = run(raw)
    message = str(failed.result(raise_on_failure=False))
    assert isinstance(failed.result(raise_on_failure=False), JobFailed)
    assert f"sample {key} in {url}/shard-000001.tar at byte {offset} is corrupt" in message
    assert "train.on_corrupt: skip" in message
    assert nothing_left(gpuflow_home)


def _bad(tmp_path: Path, s3_server) -> dict:
    from gpuflow.tasks.training.prepare import prepare

    store = FileStore()
    good = f"file://{tmp_path}/good"
    prepare("synthetic:classify?samples=32", good, 20_000, store)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "index.json").write_text(json.dumps({"shards": [], "samples": 0, "source": "x"}))
    notar = tmp_path / "notar"
    prepare("synthetic:classify?samples=32", f"file://{notar}", 20_000, store)
    (notar / "shard-000000.tar").write_bytes(b"<html>not a tar</html>" * 100)
    out = f"file://{tmp_path}/out"
    local = {"storage": {}}
    theirs = {"model": "their_models:big", "job": "their-job", "dataset": good}
    ckpt.write_manifest(
        store, f"file://{tmp_path}/theirs/checkpoints", 10, {}, {"identity": theirs}
    )
    return {
        "another job's checkpoint": (
            train_spec(good, f"file://{tmp_path}/theirs") | local,
            f"job.output: the newest checkpoint under file://{tmp_path}/theirs/checkpoints (step"
            " 10) is job 'their-job''s (model their_models:big), not this job 'cnn''s"
            " (model gpuflow.tasks.training.models:small_cnn); give this job another job.output,"
            " or set job.checkpoint.resume: any to resume from it anyway.",
        ),
        "dataset missing": (
            train_spec(f"file://{tmp_path}/nothing", out) | local,
            "has no index.json",
        ),
        "empty dataset": (train_spec(f"file://{empty}", out) | local, "is empty"),
        "shard not a tar": (
            train_spec(f"file://{notar}", out) | local,
            "shard-000000.tar is not a tar file",
        ),
        "model not installed": (
            train_spec(good, out, model="no_such_module:make") | local,
            "module 'no_such_module' is not installed here",
        ),
        "model not an import path": (
            train_spec(good, out, model="os:system; rm -rf /") | local,
            "is not an import path",
        ),
        "fsdp on cpu": (
            train_spec(good, out, strategy="fsdp", cpu_processes=1) | local,
            "fsdp shards the model across GPUs",
        ),
        "too few shards": (train_spec(good, out, num_workers=16) | local, "need at least 32"),
        "credentials refused": (
            train_spec(s3_server.url("datasets/cnn"), s3_server.url("runs/x"))
            | {"storage": {"aws_credentials": "gpuflow-bad-s3"}},
            "refused the credentials",
        ),
    }


def test_bad_inputs_are_refused_before_provisioning(
    tmp_path, s3_server, prefect_api, gpuflow_home, s3_dataset
):
    save_aws_block(s3_server, "gpuflow-bad-s3", secret="definitely-wrong-secret")
    for case, (raw, expected) in _bad(tmp_path, s3_server).items():
        state, _ = run(raw)
        error = state.result(raise_on_failure=False)
        assert isinstance(error, InvalidSpec), (case, error)
        assert expected in str(error), (case, str(error))
        assert "definitely-wrong-secret" not in str(error)
        assert nothing_left(gpuflow_home), case


def test_batch_size_zero_is_refused():
    with pytest.raises(InvalidSpec, match=r"job\.batch_size must be at least 1"):
        load_spec(train_spec("file:///d", "file:///o", batch_size=0))


def test_a_profiled_run_leaves_a_trace_of_its_active_steps_and_tables(
    s3_dataset, s3_server, gpuflow_home
):
    """job.profile {wait 1, warmup 1, active 3}: a Chrome trace of exactly three steps
    (torch.profiler's ProfilerStep#N marks), the top operators and each step's data wait vs
    compute as table artifacts; on CPU it works the same."""
    from tests.e2e.helpers import artifacts_of

    raw = train_spec(
        s3_dataset,
        s3_server.url("runs/profiled"),
        max_steps=8,
        profile={"wait": 1, "warmup": 1, "active": 3},
    )
    state, _ = run(raw)
    assert state.is_completed(), state.message
    result = state.result()
    trace = Path(result.artifacts_dir) / "outputs" / "profile" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}
    found = artifacts_of(result.flow_run_id)
    split = json.loads(found["gpuflow-profile-steps"].data)
    assert [row["step"] for row in split] == [3, 4, 5]
    assert all(row["compute_ms"] > 0 and row["data_wait_ms"] >= 0 for row in split)
    operators = json.loads(found["gpuflow-profile-operators"].data)
    assert operators and all(row["self_cpu_ms"] >= 0 for row in operators)
    assert any("aten::" in row["operator"] for row in operators)
    summary = str(found["gpuflow-summary"].data)
    assert "profile of 3 step(s): data wait" in summary and "open it in Perfetto" in summary


def test_a_profile_longer_than_the_run_is_refused():
    with pytest.raises(
        InvalidSpec, match=re.escape("wait + warmup + active is 5 steps but job.max_steps is 4")
    ):
        load_spec(train_spec("file:///d", "file:///o", max_steps=4, profile={}))


def test_idle_gpus_stop_training_after_a_checkpoint(
    s3_dataset, s3_server, gpuflow_home, aws_block, fake_nvml
):
    """limits.idle_gpu with action stop: the trainer gets SIGTERM, saves a checkpoint, and
    the run fails saying why instead of being retried as a preemption."""
    import threading

    # The GPUs look busy until the trainer is in its loop (it has logged a step), then do
    # nothing: however long its start takes, the stop finds it training.
    fake_nvml.config["util"] = 100

    def idle_once_training() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            logged = list(gpuflow_home.rglob("train_metrics.jsonl"))
            if any(path.stat().st_size for path in logged):
                fake_nvml.config["util"] = 0
                return
            time.sleep(0.2)

    threading.Thread(target=idle_once_training, daemon=True).start()
    raw = train_spec(s3_dataset, s3_server.url("runs/idle"), max_steps=100000)
    raw |= {
        "resources": {"gpus": 1, "allow_cpu": True},
        "metrics": {"interval_s": 0.2},
        # the grace for the step and the checkpoint on a busy machine (the ranks may be
        # fetching shards when the stop comes); torchrun is given the same
        "limits": {"idle_gpu": {"for": "5s", "action": "stop"}, "stop_grace_s": 120},
    }
    state, run_id = run(raw)
    assert state.is_failed()
    assert "limits.idle_gpu" in state.message and "was stopped because" in state.message
    [run_task] = [t for t in task_runs_of(run_id) if t.name.startswith("run")]
    assert run_task.run_count == 1
    assert "preempted at step" in "\n".join(logs_of(run_id))  # it saved on SIGTERM
    store = S3Store(s3_server.settings())
    assert store.list(s3_server.url("runs/idle/checkpoints"))
    assert nothing_left(gpuflow_home)


def test_the_model_factory_runs_only_in_the_job_process(tmp_path, prefect_api, gpuflow_home):
    """job.model os:system with a command in model_args: checking the spec (and refusing
    it) runs nothing in gpuflow's process; the factory is called in the job's own process,
    whose failure is one sentence naming job.model."""
    from gpuflow.tasks.training.prepare import prepare

    data = f"file://{tmp_path}/data"
    prepare("synthetic:classify?samples=32", data, 20_000, FileStore())
    marker = tmp_path / "ran"
    small = {"cpu_processes": 1, "num_workers": 0, "max_steps": 2}

    def spec(job: dict) -> dict:
        out = f"file://{tmp_path}/out"
        return train_spec(data, out, **small, **job) | {"storage": {}, "retry": {}}

    cases = {
        "os:system": (
            {"model": "os:system", "model_args": {"command": f"touch {marker}"}},
            "returned int, not a torch.nn.Module",
        ),
        "builtins:dict": ({"model": "builtins:dict"}, "returned dict, not a torch.nn.Module"),
        "os.path:join": ({"model": "os.path:join"}, "job.model: os.path:join(**model_args) failed"),
        "no factory": ({"model": "json:no_such"}, "json has no function 'no_such'"),
    }
    from gpuflow.tasks.pipeline.checks import check_spec

    for case, (job, _) in cases.items():
        check_spec(load_spec(spec(job)))
        assert not marker.exists(), case  # the check read the name only
    for case, (job, expected) in cases.items():
        state, _ = run(spec(job))
        error = state.result(raise_on_failure=False)
        assert isinstance(error, JobFailed), (case, error)
        assert expected in str(error), (case, str(error))
        assert "Traceback" not in str(error)
        assert nothing_left(gpuflow_home), case
    assert marker.exists()  # os.system ran, in the job's own process
