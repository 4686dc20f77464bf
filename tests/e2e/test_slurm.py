"""Jobs on Slurm (placement.backend: slurm) through gpu_pipeline on the Slurm test cluster
(scripts/slurm-testbed.sh): what runs where, what Slurm hands each unit, what is left
(asked of squeue and the filesystem), and bad input refused before anything is submitted."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_spec
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import command_lines_seen, logs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def gpuflow_jobs() -> list[str]:
    """Return the jobs in squeue whose comment says gpuflow made them."""
    out = subprocess.run(
        ["squeue", "-h", "-a", "-o", "%i %k"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if "gpuflow.io/owner" in line]


def cancel_gpuflow_jobs() -> None:
    """Cancel the jobs gpuflow made: what a failed test's run still holds."""
    jobs = [line.split(" ", 1)[0] for line in gpuflow_jobs()]
    if jobs:
        subprocess.run(["scancel", *jobs], check=False)


def wait_for_main_step(going: Callable[[], bool], limit_s: float = 120) -> str:
    """Return the node of a run's unit `main` once it runs as a step; fail when `going()`
    turns false (the orchestrator ended) or after `limit_s`."""
    import time

    until = time.monotonic() + limit_s
    while True:
        steps = subprocess.run(
            ["squeue", "-h", "-s", "-o", "%j %N"], capture_output=True, text=True, check=True
        ).stdout
        for line in steps.splitlines():
            name, _, node = line.partition(" ")
            if ".main." in name:
                return node.strip()
        assert time.monotonic() < until and going(), "the unit never ran"
        time.sleep(0.2)


def spec(tmp_path: Path, command: list[str], **over) -> dict:
    raw = {
        "name": "on-slurm",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 4, "gpu_product": "H100", "nodes": 2},
        "placement": {"backend": "slurm", "workspace_root": str(tmp_path / "workspaces")},
        "limits": {"max_duration": "10m"},
    }
    for key, value in over.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def test_a_command_on_two_nodes_runs_in_one_allocation_and_leaves_nothing(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    """The allocation holds 2 nodes of 4 x gpu:h100; the command runs on the first with
    the 4 GPUs Slurm gave it; secrets reach it through the environment, never through
    anything Slurm shows; the job and its workspace are gone afterwards."""
    from prefect.blocks.system import Secret

    value = "tok-5a4b3c2d1e-SLURM"
    Secret(value=value).save("gpuflow-slurm-token", overwrite=True)
    show = (
        'echo "on $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES nodes=$GPUFLOW_NODES token=$HF_TOKEN"'
    )
    raw = spec(tmp_path, ["bash", "-c", show])
    raw["secret_env"] = {"HF_TOKEN": "gpuflow-slurm-token"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    run_id = state.state_details.flow_run_id
    job = result.cluster.state["job_id"]
    assert result.cluster.node_names == ["g1", "g2"] and result.cluster.gpu_indices == [0, 1, 2, 3]
    logs = logs_of(run_id)
    assert any("on g1 gpus=0,1,2,3 nodes=2 token=***" in line for line in logs), logs
    assert not any(value in line for line in logs)
    shown = subprocess.run(
        ["scontrol", "show", "job", "-dd", job], capture_output=True, text=True, check=False
    )
    assert value not in shown.stdout + shown.stderr
    assert gpuflow_jobs() == []
    assert not (tmp_path / "workspaces" / result.cluster.name).exists()


def test_a_copy_on_each_gpu_gets_a_gpu_of_its_own_on_both_nodes(
    slurm, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """copies: per_gpu on 2 nodes x 4 GPUs: 8 one-GPU steps in the run's one allocation,
    each told its number, no two on one GPU (steps that share the allocation's resources
    would all get the node's first GPU); one sampler per node samples its GPUs."""
    import json

    from tests.conftest import FAKES

    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    monkeypatch.setenv("FAKE_NVML_GPUS", "4")
    show = 'echo "copy $GPUFLOW_TASK_INDEX/$GPUFLOW_TASKS on $SLURMD_NODENAME gpu=$CUDA_VISIBLE_DEVICES"'
    raw = spec(tmp_path, ["bash", "-c", show + "; sleep 2"])
    raw["job"]["copies"] = "per_gpu"
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    logs = "\n".join(logs_of(state.state_details.flow_run_id)).splitlines()
    said = [line.split("copy ", 1)[1] for line in logs if "copy " in line]
    copies = sorted(said, key=lambda line: int(line.split("/")[0]))
    assert copies == [f"{i}/8 on g{i // 4 + 1} gpu={i % 4}" for i in range(8)], (
        copies
    )  # the kind's order: node 0's GPUs, then node 1's
    lines = (Path(result.artifacts_dir) / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert {s["Hostname"] for s in samples} == {"g1", "g2"}
    assert all([g["gpu"] for g in s["gpus"]] == [0, 1, 2, 3] for s in samples)
    assert gpuflow_jobs() == []


@pytest.mark.parametrize(
    ("over", "said"),
    [
        (
            {"placement": {"partition": "a100"}},
            "placement.partition: 'a100' is not a partition of this Slurm cluster; use one of:"
            " gpu, l4, urgent.",
        ),
        (
            {"resources": {"gpu_product": "A100"}},
            "resources.gpu_product: no node of partition gpu has gpu:a100 (it has gpu:h100);",
        ),
        (
            {"resources": {"gpus": 8, "nodes": 1}},
            "resources.gpus: the job needs 8 x gpu:h100 on one node; the largest node in"
            " partition gpu has 4; lower resources.gpus or use 2 nodes.",
        ),
        (
            {"resources": {"nodes": 3}},
            "resources.nodes: the job needs 3 nodes with 4 x gpu:h100; partition gpu has 2;",
        ),
        (
            {"limits": {"max_duration": "2h"}},
            "limits.max_duration: with its grace the allocation needs 122 min, and partition"
            " gpu allows 60 min;",
        ),
    ],
)
def test_what_the_cluster_could_never_run_is_refused_before_anything_is_submitted(
    slurm, tmp_path, over, said
):
    with pytest.raises(InvalidSpec) as refused:
        check_spec(load_spec(spec(tmp_path, ["true"], **over)))
    assert said in str(refused.value)
    assert gpuflow_jobs() == []


def test_no_slurm_client_or_a_missing_slurm_conf_is_one_sentence(slurm, tmp_path, monkeypatch):
    raw = spec(tmp_path, ["true"])
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere.conf"))
    with pytest.raises(InvalidSpec, match=r"^SLURM_CONF: .*nowhere.conf does not exist; point"):
        check_spec(load_spec(raw))
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    with pytest.raises(InvalidSpec, match=r"needs the Slurm client .* and it has none; install"):
        check_spec(load_spec(raw))


def test_reap_cancels_what_a_killed_gpuflow_left_and_marks_its_run_crashed(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    import json
    import os
    import signal
    import sys

    from gpuflow.tasks.api_client import api_client
    from tests.conftest import subprocess_env
    from tests.e2e.helpers import process_gone

    root = Path(__file__).resolve().parents[2]
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(spec(tmp_path, ["sleep", "300"], resources={"nodes": 1})))
    env = {**subprocess_env(prefect_api, gpuflow_home), "SLURM_CONF": str(slurm)}
    gpuflow = [sys.executable, "-m", "gpuflow"]
    orchestrator = subprocess.Popen(
        [*gpuflow, "run", str(job)],
        env=env,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    wait_for_main_step(lambda: orchestrator.poll() is None)
    (held,) = gpuflow_jobs()
    run_id = json.loads(held.split(" ", 1)[1])["gpuflow.io/flow-run-id"]
    os.kill(orchestrator.pid, signal.SIGKILL)
    orchestrator.wait(timeout=30)
    assert process_gone(orchestrator.pid)

    def reap(*options: str) -> subprocess.CompletedProcess:
        command = [*gpuflow, "reap", "--backend", "slurm", *options]
        return subprocess.run(
            command, env=env, cwd=root, capture_output=True, text=True, timeout=120
        )

    looked = reap("--dry-run")
    assert looked.returncode == 0, looked.stderr
    assert f"of run {run_id}: its gpuflow is dead; would cancel" in looked.stdout
    assert len(gpuflow_jobs()) == 1  # a dry run cancels nothing
    reaped = reap()
    assert reaped.returncode == 0, reaped.stderr
    assert (
        "1 leftover cluster(s)" in reaped.stdout and "1 flow run(s) marked Crashed" in reaped.stdout
    )
    assert gpuflow_jobs() == []
    assert not (tmp_path / "workspaces" / f"gpuflow-{run_id}").exists()
    with api_client() as client:
        assert client.read_flow_run(run_id).state.type.value == "CRASHED"


def take_by_urgent_job(node: str) -> Callable[[], None]:
    """Start a job of the urgent partition on every H100; return what checks its end."""
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N2", "--gres=gpu:h100:4", "-o", "/dev/null",
         "--wrap", "sleep 5"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip

    def check() -> None:
        shown = subprocess.run(
            ["scontrol", "show", "job", urgent], capture_output=True, text=True, check=False
        ).stdout
        assert "JobState=COMPLETED" in shown or not shown  # the urgent job ran first, to its end

    return check


def take_by_node_down(node: str) -> Callable[[], None]:
    """Set the unit's node DOWN (as an administrator would); return what checks that it came
    back (the test cluster returns a node to service once its slurmd registers again)."""
    subprocess.run(
        ["scontrol", "update", f"nodename={node}", "state=down", "reason=gpuflow-test"],
        check=True,
    )

    def check() -> None:
        shown = subprocess.run(
            ["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, check=True
        ).stdout
        assert "down" not in shown, shown

    return check


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "take", [take_by_urgent_job, take_by_node_down], ids=["preempted", "node-down"]
)
def test_a_unit_whose_gpus_are_taken_saves_its_state_and_the_run_resumes_when_slurm_runs_it_again(
    take, slurm, prefect_api, gpuflow_home, tmp_path
):
    """A job of the urgent partition takes the run's GPUs, or an administrator sets the
    unit's node DOWN: the unit gets SIGTERM and its grace, saves its state and exits 75;
    Slurm requeues the run's job; the run stage retries, waits until Slurm runs the job
    again (after its requeue delay, and once the urgent job is done) and the unit resumes
    from what it saved."""
    import threading

    script = (
        'n=$(cat "$GPUFLOW_WORKSPACE/../saved" 2>/dev/null || echo 0); echo "attempt $n";'
        ' if [ "$n" -ge 1 ]; then echo resumed; exit 0; fi;'
        " trap 'echo $((n+1)) > \"$GPUFLOW_WORKSPACE/../saved\"; echo saved; exit 75' TERM;"
        # Slurm signals every process of the step: when the sleep's end reaches bash before
        # its own SIGTERM, `wait` returns and bash would end the script before its trap
        # runs. It waits again instead, so only the trap ends it.
        ' touch "$GPUFLOW_WORKSPACE/../ready"; while :; do sleep 300 & wait; done'
    )
    raw = spec(tmp_path, ["bash", "-c", script], resources={"nodes": 1})
    raw["retry"] = {"run": {"retries": 2, "delay_s": 1}}
    done: dict = {}
    flow = threading.Thread(
        target=lambda: done.update(state=gpu_pipeline(load_spec(raw), return_state=True))
    )
    flow.start()

    node = wait_for_main_step(flow.is_alive)
    # the step runs before its unit does: take the GPUs once the unit would save its state
    until = time.monotonic() + 120
    while not list(tmp_path.glob("workspaces/**/ready")):
        assert flow.is_alive() and time.monotonic() < until, "the unit never started"
        time.sleep(0.1)
    try:
        check = take(node)
        flow.join(timeout=240)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    if flow.is_alive():  # say where it waits (its thread's stack), then fail
        import sys
        import traceback

        stack = "".join(traceback.format_stack(sys._current_frames()[flow.ident]))
        cancel_gpuflow_jobs()  # the next test finds the cluster free
        pytest.fail(f"the run did not end; it waits in:\n{stack}")
    state = done["state"]
    assert state.is_completed(), state.message
    logs = logs_of(state.state_details.flow_run_id)
    text = "\n".join(logs)
    for said in ("attempt 0", "saved", "attempt 1", "resumed"):
        assert said in text, text
    assert "exit 75" in text  # the run stage said it was interrupted and retried
    check()
    assert gpuflow_jobs() == []


def test_the_slurm_example_runs_from_the_command_line(slurm, prefect_api, gpuflow_home):
    import sys

    from tests.conftest import subprocess_env

    root = Path(__file__).resolve().parents[2]
    env = {**subprocess_env(prefect_api, gpuflow_home), "SLURM_CONF": str(slurm)}
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "run", "examples/slurm-command.yaml"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "on g1 with GPUs 0,1,2,3 of node 0 / 2" in done.stdout + done.stderr
    assert gpuflow_jobs() == []


def test_an_allocation_that_waits_for_busy_gpus_past_gpu_wait_is_a_capacity_error(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    import time

    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.contract import owner_labels
    from gpuflow.tasks.errors import CapacityError

    holder = subprocess.run(
        ["sbatch", "--parsable", "-p", "gpu", "-N2", "--gres=gpu:h100:4", "-o", "/dev/null",
         "--wrap", "sleep 300"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        held = ["squeue", "-h", "-j", holder, "-o", "%T"]
        until = time.monotonic() + 60
        while subprocess.run(held, capture_output=True, text=True).stdout.strip() != "RUNNING":
            assert time.monotonic() < until, "the job holding every H100 never ran"
            time.sleep(0.2)
        job = load_spec(spec(tmp_path, ["true"], placement={"gpu_wait": "2s"}))
        backend = get_backend("slurm", job.placement)
        backend.check(job)  # it fits the cluster: it is only busy
        with pytest.raises(CapacityError) as busy:
            backend.provision(job, owner_labels("busy-run", job.name))
        said = str(busy.value)
        assert (
            "the Slurm cluster has no room for this job now: it waits for 2 node(s) x"
            " gpu:h100:4; partition gpu has 0 gpu:h100 idle now (squeue says"
        ) in said
        assert "placement.gpu_wait (2 s) has passed; the job was cancelled" in str(busy.value)
        assert gpuflow_jobs() == []
    finally:
        subprocess.run(["scancel", holder], check=True)


@pytest.mark.parametrize(
    ("signame", "code", "said"),
    [("SIGTERM", 143, "stopped by SIGTERM"), ("SIGINT", 130, "stopped by SIGINT (Ctrl-C)")],
)
def test_a_signal_to_gpuflow_stops_the_unit_and_cancels_the_job(
    signame, code, said, slurm, prefect_api, gpuflow_home, tmp_path
):
    import json
    import signal
    import sys

    from tests.conftest import subprocess_env

    root = Path(__file__).resolve().parents[2]
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(spec(tmp_path, ["sleep", "300"], resources={"nodes": 1})))
    env = {**subprocess_env(prefect_api, gpuflow_home), "SLURM_CONF": str(slurm)}
    orchestrator = subprocess.Popen(
        [sys.executable, "-m", "gpuflow", "run", str(job)],
        env=env,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    wait_for_main_step(lambda: orchestrator.poll() is None)
    os.kill(orchestrator.pid, getattr(signal, signame))
    out, _ = orchestrator.communicate(timeout=120)
    assert orchestrator.returncode == code, out[-2000:]
    assert said in out and "Traceback" not in out
    assert gpuflow_jobs() == []


def test_preflight_shows_the_partition_its_idle_gpus_and_whether_the_job_fits(
    slurm, tmp_path, capsys
):
    import json

    from gpuflow.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(spec(tmp_path, ["true"])))
    assert main(["preflight", str(job)]) == 0
    out = capsys.readouterr().out
    assert f"[pass] cluster: the Slurm client here, SLURM_CONF={slurm}" in out
    assert "[pass] partition: gpu: 2 node(s) (g1, g2); GPUs idle now: gpu:h100 8" in out
    assert "[pass] fit: the job fits: 2 node(s) x gpu:h100:4, --time 12 min" in out
    job.write_text(json.dumps(spec(tmp_path, ["true"], resources={"nodes": 3})))
    assert main(["preflight", str(job)]) == 1
    assert "[fail] fit: resources.nodes: the job needs 3 nodes" in capsys.readouterr().out


def test_render_chunks_spread_over_both_nodes_and_upload_their_frames(
    slurm, prefect_api, s3_server, s3_scene, gpuflow_home, tmp_path
):
    """8 frames in chunks of 2 on 2 nodes x 4 GPUs: each chunk a step of one GPU that
    fetches the scene from S3, runs Blender and uploads its frames; a rerun renders none."""
    from gpuflow.flows.render import render
    from gpuflow.tasks.storage import store_for

    output = s3_server.url("slurm-renders/cube")
    raw = {
        "name": "slurm-render",
        "job": {"kind": "render", "scene": s3_scene, "output": output, "chunk": 2, "device": "CPU"},
        "resources": {"gpus": 4, "gpu_product": "H100", "nodes": 2},
        "placement": {"backend": "slurm", "workspace_root": str(tmp_path / "workspaces")},
        "limits": {"max_duration": "10m"},
        "metrics": {"plot": False},
    }
    state = render(raw, return_state=True)
    assert state.is_completed(), state.message
    store = store_for(output, s3_server.settings())
    assert sorted(o.url for o in store.list(output)) == [
        f"{output}/frame_{i:04d}.png" for i in range(1, 9)
    ]
    job = state.result().metrics.job
    assert (job["frames_rendered"], job["frames_missing"], job["chunks"]) == (8, 0, 4)
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    secret = s3_server.settings().secret_access_key.get_secret_value()
    assert secret not in logs
    assert gpuflow_jobs() == []
    rerun = render(raw, return_state=True)
    assert rerun.is_completed(), rerun.message
    assert rerun.result().metrics.job["frames_skipped"] == 8


@pytest.mark.timeout(420)
def test_training_on_two_nodes_preempted_part_way_resumes_to_the_weights_of_a_straight_run(
    slurm, prefect_api, s3_server, tmp_path
):
    """resources.nodes: 2 is one torchrun per node, each a step of the run's job, meeting
    at the first node's NodeAddr on a port of the job's own (two ranks, gloo on CPU). The
    same 20 steps with a job of the urgent partition taking both nodes at step 6 (the ranks
    held there until its SIGTERM reaches them): the ranks checkpoint in the grace, Slurm requeues the job, the run resumes from the checkpoint
    and ends with the straight run's weights, bitwise."""
    import io

    import torch

    from gpuflow.flows.datasets import prepare_dataset
    from gpuflow.flows.train import train
    from gpuflow.tasks.storage import S3Store
    from tests.conftest import save_aws_block
    from tests.e2e.helpers import hold_ranks_at, release_when_signalled
    from tests.e2e.test_training import train_spec

    save_aws_block(s3_server, "gpuflow-test-aws")
    dataset = s3_server.url("datasets/slurm-two")
    prepare_dataset("synthetic:classify?samples=128", dataset, "40KB", "gpuflow-test-aws")

    def spec_to(name: str) -> dict:
        # the worker's bucket is shared: test_training's "runs/straight" holds another
        # training's checkpoints, which a run writing there would resume from
        output = s3_server.url(f"runs/slurm-two-nodes-{name}")
        raw = train_spec(dataset, output, max_steps=20, cpu_processes=1)
        raw["storage"] = {"aws_credentials": "gpuflow-test-aws"}
        raw["resources"] = {"gpus": 1, "gpu_product": "H100", "nodes": 2}
        raw["placement"] = {"backend": "slurm", "workspace_root": str(tmp_path / name)}
        raw["limits"] = {"max_duration": "10m"}
        return raw

    straight = train(load_spec(spec_to("straight")), return_state=True)
    assert straight.is_completed(), straight.message
    result = straight.result()
    assert result.metrics.job["world_size"] == 2 and result.metrics.job["steps"] == 20
    assert result.cluster.rendezvous.startswith("127.0.0.1:")

    done: dict = {}
    flow = threading.Thread(
        target=lambda: done.update(state=train(load_spec(spec_to("taken")), return_state=True))
    )
    flow.start()
    # preempt early: the ranks save their state on SIGTERM
    held, stopped_at = hold_ranks_at(tmp_path / "taken", 6, ranks=2, seconds=180)
    take_by_urgent_job("g1")
    release_when_signalled(held)
    flow.join(timeout=300)
    if flow.is_alive():  # say where it waits (its thread's stack), then fail
        import sys
        import traceback

        stack = "".join(traceback.format_stack(sys._current_frames()[flow.ident]))
        pytest.fail(f"the run did not end; it waits in:\n{stack}")
    resumed = done["state"]
    assert resumed.is_completed(), resumed.message
    assert stopped_at < 20
    logs = "\n".join(logs_of(resumed.state_details.flow_run_id))
    assert "resumed from checkpoint step" in logs, logs
    store = S3Store(s3_server.settings())

    def weights(state) -> dict:
        url = state.result().metrics.job["weights"]
        return torch.load(io.BytesIO(store.read_bytes(url)), weights_only=True)

    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert gpuflow_jobs() == []


def test_a_slurm_cluster_block_sets_partition_account_gres_and_price(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    """The block's partition and gres map place the job (here on the L4 node, its gres
    named by the map), its account and extra options reach sbatch, its price costs the
    run; a block that does not exist is named before anything is submitted."""
    from gpuflow.blocks import SlurmCluster

    SlurmCluster(
        partition="l4",
        account="ml-team",
        gres_types={"L4": "l4"},
        workspace_root=str(tmp_path / "shared"),
        sbatch_options=["--exclusive"],
        gpu_hourly_usd=3600.0,
    ).save("test-slurm", overwrite=True)
    show = 'echo "on $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES"'
    raw = spec(
        tmp_path, ["bash", "-c", show], resources={"gpus": 2, "gpu_product": "L4", "nodes": 1}
    )
    raw["placement"] = {"backend": "slurm", "block": "test-slurm"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.cluster.node_names == ["l1"]
    assert result.cluster.workspace.startswith(str(tmp_path / "shared"))
    logs = logs_of(state.state_details.flow_run_id)
    assert any("on l1 gpus=0,1" in line for line in logs), logs
    shown = subprocess.run(
        ["scontrol", "show", "job", result.cluster.state["job_id"]],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "Account=ml-team" in shown and "OverSubscribe=NO" in shown  # --exclusive
    # 2 GPUs at $1 a second, for as long as the unit ran
    assert result.metrics.cost_usd == pytest.approx(2 * result.metrics.duration_s)
    raw["placement"] = {"backend": "slurm", "block": "no-such-block"}
    with pytest.raises(InvalidSpec, match="there is no SlurmCluster block named 'no-such-block'"):
        check_spec(load_spec(raw))
    # a QOS on a cluster without accounting: Slurm would ignore it, gpuflow says so
    SlurmCluster(partition="l4", qos="gold", workspace_root=str(tmp_path / "shared")).save(
        "test-slurm-qos", overwrite=True
    )
    raw["placement"] = {"backend": "slurm", "block": "test-slurm-qos"}
    with pytest.raises(InvalidSpec) as refused:
        check_spec(load_spec(raw))
    assert str(refused.value) == (
        "qos: the Slurm cluster keeps no accounting (accounting_storage/none), so it has no"
        " QOS and would ignore 'gold'; remove qos from the SlurmCluster block."
    )
    assert gpuflow_jobs() == []


def test_a_slurm_cluster_block_refuses_options_gpuflow_sets():
    from gpuflow.blocks import SlurmCluster

    with pytest.raises(ValueError, match="--time is set by gpuflow from the job spec"):
        SlurmCluster(sbatch_options=["--time=10"])
    with pytest.raises(ValueError, match="'exclusive' is not an sbatch option"):
        SlurmCluster(sbatch_options=["exclusive"])


def test_a_slurm_client_that_knows_no_cluster_is_one_sentence(tmp_path, monkeypatch):
    """No SLURM_CONF and no slurm.conf where the client looks (this machine has none)."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a Slurm cluster of its own in /etc/slurm")
    with pytest.raises(
        InvalidSpec, match=r"the Slurm client here knows no cluster .* set SLURM_CONF"
    ):
        check_spec(load_spec(spec(tmp_path, ["true"])))


def test_md_over_two_nodes_runs_mpirun_in_the_allocation_and_matches_the_local_energies(
    slurm, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """An hpc job on 2 nodes: one launcher step on the first node starts mpirun, whose
    daemons Slurm starts on both nodes (srun inside the job); the ranks' step-0 energy is
    the energy of the same MD run on this machine."""
    from gpuflow.flows.hpc import hpc
    from tests.e2e.test_hpc import RANKS_AGREE_REL, hpc_spec, thermo

    md = {"atoms": 500, "steps": 40, "thermo_every": 20}
    local = hpc(hpc_spec("md-local", ranks=2, md=md), return_state=True)
    assert local.is_completed(), local.message
    # The test cluster's nodes are one machine: Open MPI's shared-memory transport would
    # give ranks of "different nodes" the same segment names; its TCP one over loopback
    # is what ranks on two real nodes use.
    for name, value in {"btl": "self,tcp", "btl_tcp_if_include": "lo"}.items():
        monkeypatch.setenv(f"OMPI_MCA_{name}", value)
    raw = hpc_spec("md-slurm", ranks=4, slots=2, md=md)
    raw["resources"] = {"gpus": 4, "gpu_product": "H100", "nodes": 2}
    raw["placement"] = {"backend": "slurm", "workspace_root": str(tmp_path / "workspaces")}
    raw["limits"] = {"max_duration": "10m"}
    state = hpc(raw, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.metrics.job["ranks"] == 4
    here = thermo(Path(local.result().artifacts_dir))
    there = thermo(Path(result.artifacts_dir))
    assert [r["step"] for r in there] == [r["step"] for r in here] == [0, 20, 40]
    for key in ("total_per_atom", "potential_per_atom", "temperature"):
        assert there[0][key] == pytest.approx(here[0][key], rel=RANKS_AGREE_REL), key
    text = "\n".join(logs_of(result.flow_run_id))
    assert "mpirun: 4 rank(s) on g1, g2" in text  # the ranks went to both of the job's nodes
    assert gpuflow_jobs() == []
    assert not list((tmp_path / "workspaces").iterdir())


@pytest.fixture
def login_node(slurm, tmp_path):
    """A login node for the test cluster (sshd on loopback, key-only) and the key it
    accepts; the Slurm client here has no SLURM_CONF, so only the login node knows the
    cluster."""
    from tests.e2e.sshd import LoginNode, keypair

    private, public = keypair(tmp_path, "user_key")
    node = LoginNode(tmp_path / "sshd", slurm, [public])
    yield node, private
    node.stop()


def save_login_block(name: str, node, key: str, tmp_path: Path, **over) -> None:
    from prefect.blocks.system import Secret

    from gpuflow.blocks import SlurmCluster

    Secret(value=key).save(f"{name}-key", overwrite=True)
    settings = {
        "login_host": "127.0.0.1",
        "login_port": node.port,
        "login_user": "root",
        "ssh_key": f"{name}-key",
        "known_hosts": node.known_hosts,
        "workspace_root": str(tmp_path / "shared"),
        **over,
    }
    SlurmCluster(**settings).save(name, overwrite=True)


def test_a_job_reaches_the_cluster_through_its_login_node_over_ssh(
    login_node, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """With a login_host every Slurm command goes over SSH (the key from a Secret block,
    the host key checked): the run's steps run on both nodes, a secret reaches the unit
    through ssh's standard input (no command line, nothing Slurm shows), and the job and
    its workspace on the cluster are gone afterwards."""
    from prefect.blocks.system import Secret

    node, key = login_node
    slurm_conf = os.environ.pop("SLURM_CONF")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    save_login_block("test-login", node, key, tmp_path)
    value = "tok-ssh-9f8e7d6c5b"
    Secret(value=value).save("gpuflow-slurm-ssh-token", overwrite=True)
    show = 'echo "on $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES token=$HF_TOKEN"'
    raw = spec(tmp_path, ["bash", "-c", show])
    raw["placement"] = {"backend": "slurm", "block": "test-login"}
    raw["secret_env"] = {"HF_TOKEN": "gpuflow-slurm-ssh-token"}
    with command_lines_seen() as seen:  # every command line on this machine meanwhile
        state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.cluster.node_names == ["g1", "g2"]
    logs = logs_of(state.state_details.flow_run_id)
    assert any("on g1 gpus=0,1,2,3 token=***" in line for line in logs), logs
    assert not any(value in line for line in [*logs, *seen])
    assert any("ssh" in line and "srun" in line for line in seen)  # srun went over SSH
    assert "Accepted publickey for root" in node.log()
    monkeypatch.setenv("SLURM_CONF", slurm_conf)
    assert gpuflow_jobs() == []
    assert not (tmp_path / "shared" / result.cluster.name).exists()


@pytest.mark.parametrize("wrong", ["key", "host key"])
def test_a_refused_key_or_a_changed_host_key_is_one_sentence_and_nothing_is_submitted(
    wrong, login_node, prefect_api, tmp_path
):
    from tests.e2e.sshd import keypair

    node, key = login_node
    other_key, other_public = keypair(tmp_path, "other")
    if wrong == "key":
        save_login_block("test-login-bad", node, other_key, tmp_path)
        said = (
            f"ssh_key: the login node 127.0.0.1:{node.port} refuses the key of Secret block"
            " 'test-login-bad-key' for user root; add its public key to"
            " ~root/.ssh/authorized_keys there, or name the right key."
        )
    else:
        forged = f"[127.0.0.1]:{node.port} {' '.join(other_public.split()[:2])}\n"
        save_login_block("test-login-bad", node, key, tmp_path, known_hosts=forged)
        said = f"known_hosts: the login node 127.0.0.1:{node.port} shows a host key other than"
    raw = spec(tmp_path, ["true"])
    raw["placement"] = {"backend": "slurm", "block": "test-login-bad"}
    with pytest.raises(InvalidSpec) as refused:
        check_spec(load_spec(raw))
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert gpuflow_jobs() == []


def test_a_job_slurm_will_not_start_is_cancelled_with_the_reason_and_its_fix(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    """Partition l4 set DOWN by an administrator: the allocation pends with reason
    PartitionDown, which no wait clears; the run fails with that in words, its job
    cancelled, nothing left."""
    raw = spec(tmp_path, ["true"], resources={"gpus": 2, "gpu_product": "L4", "nodes": 1})
    raw["placement"]["partition"] = "l4"
    subprocess.run(["scontrol", "update", "partitionname=l4", "state=down"], check=True)
    try:
        state = gpu_pipeline(load_spec(raw), return_state=True)
    finally:
        subprocess.run(["scontrol", "update", "partitionname=l4", "state=up"], check=True)
    assert state.is_failed()
    assert (
        "Slurm cannot start this job: partition l4 is down; wait until its administrators bring"
        " it up, or use another partition (placement.partition); the job was cancelled"
    ) in state.message
    assert "Traceback" not in state.message
    assert gpuflow_jobs() == []


def test_the_gpus_of_a_units_node_are_sampled_on_that_node(
    slurm, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """A step beside the unit's, with its GPUs, samples them on the unit's node (NVML there:
    here the fake one, through the variables srun passes on); the run's summary has their
    utilisation, and the samples name the node."""
    import json

    from tests.conftest import FAKES

    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    monkeypatch.setenv("FAKE_NVML_GPUS", "4")
    raw = spec(tmp_path, ["sleep", "3"], resources={"nodes": 1})
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.metrics.gpu_util_mean == pytest.approx(88.5)  # 87 + index, GPUs 0-3
    lines = (Path(result.artifacts_dir) / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) >= 2 and {s["Hostname"] for s in samples} == {"g1"}
    assert [g["gpu"] for g in samples[-1]["gpus"]] == [0, 1, 2, 3]
    steps = subprocess.run(
        ["squeue", "-h", "-s", "-o", "%j"], capture_output=True, text=True, check=True
    ).stdout
    assert ".sampler" not in steps  # the sampler's step ended with the unit
    assert gpuflow_jobs() == []


@pytest.mark.timeout(420)
def test_idle_gpus_on_the_nodes_stop_the_job(
    slurm, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """limits.idle_gpu on Slurm: the samples the nodes write into the shared workspace are
    read as they come; GPUs at 0 % past `for` stop the unit (SIGTERM to its step) and the
    run ends saying why, with nothing left."""
    from tests.conftest import FAKES

    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    monkeypatch.setenv("FAKE_NVML_GPUS", "4")
    monkeypatch.setenv("FAKE_NVML_UTIL", "0")
    raw = spec(tmp_path, ["sleep", "600"], resources={"nodes": 1})
    raw["limits"]["idle_gpu"] = {"below_pct": 5, "for": "2s", "action": "stop"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_failed()
    assert "the job was stopped because its GPUs (0, 1, 2, 3) were under 5% busy" in (
        state.message
    ), state.message
    logs = logs_of(state.state_details.flow_run_id)
    assert any("idle GPUs:" in line and "stopping the job" in line for line in logs), logs
    assert gpuflow_jobs() == []


def test_reap_through_the_login_node_cancels_the_job_of_a_run_its_api_does_not_know(
    login_node, prefect_api, gpuflow_home, tmp_path, monkeypatch, capsys
):
    """`gpuflow reap --backend slurm --block B` asks the cluster B's login node reaches: the
    allocation of a run its API does not know is cancelled and its workspace removed, over
    SSH; a block whose key the login node refuses is one sentence."""
    from gpuflow.cli import main
    from gpuflow.tasks.backends.slurm.backend import SlurmBackend
    from gpuflow.tasks.contract import owner_labels
    from tests.e2e.sshd import keypair

    node, key = login_node
    slurm_conf = os.environ.pop("SLURM_CONF")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    save_login_block("test-login-reap", node, key, tmp_path)
    raw = spec(tmp_path, ["true"], resources={"nodes": 1})
    raw["placement"] = {"backend": "slurm", "block": "test-login-reap"}
    spec_ = load_spec(raw)
    backend = SlurmBackend("test-login-reap")
    run_id = "00000000-0000-4000-8000-00000000dead"  # no such flow run
    cluster = backend.provision(spec_, owner_labels(run_id, "reap-test"))
    assert Path(cluster.workspace).is_dir()

    assert main(["reap", "--backend", "slurm", "--block", "test-login-reap"]) == 0
    out = capsys.readouterr().out
    assert f"of run {run_id}: its flow run is unknown; cancelled" in out, out
    assert not Path(cluster.workspace).exists()
    monkeypatch.setenv("SLURM_CONF", slurm_conf)
    assert gpuflow_jobs() == []

    other_key, _ = keypair(tmp_path, "not-authorized")
    save_login_block("test-login-reap", node, other_key, tmp_path)
    assert main(["reap", "--backend", "slurm", "--block", "test-login-reap"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [said] = [line for line in err.splitlines() if "invalid" in line]
    assert said.startswith("gpuflow: invalid input: ssh_key: the login node 127.0.0.1:")
    assert "refuses the key of Secret block 'test-login-reap-key'" in said


OWN_CODE = Path(__file__).resolve().parents[1] / "fixtures" / "owncode"


def test_the_readme_example_runs_in_its_working_folder_on_a_slurm_node(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    """job.workdir reaches the nodes through the shared file system: the unit starts in
    it, after its setup, with ${GPUFLOW_OUTPUT_DIR} expanded on the node."""
    import shutil

    folder = tmp_path / "project"
    shutil.copytree(OWN_CODE, folder)
    out = "${GPUFLOW_OUTPUT_DIR}/model.json"
    raw = spec(tmp_path, ["python", "train.py", "--epochs", "3", "--out", out])
    raw["job"] |= {"workdir": str(folder), "setup": ["echo set up on $SLURMD_NODENAME"]}
    raw["resources"] = {"gpus": 1, "gpu_product": "H100"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "set up on g1" in logs and "epoch 2 loss 0.8333" in logs
    assert "files here: .gitignore,data,ddp.py,train.py" in logs
    model = Path(state.result().artifacts_dir) / "outputs" / "model.json"
    assert json.loads(model.read_text())["epochs"] == 3
    assert gpuflow_jobs() == []


def test_torchrun_on_two_nodes_all_reduces_checkpoints_on_sigterm_and_resumes(
    slurm, prefect_api, gpuflow_home, tmp_path
):
    """launcher: torchrun: one torchrun per node of the allocation, meeting at the first
    node's address on the job's port; a rank on each node; the all-reduce over both is
    3; SIGTERM -> checkpoint -> exit 75 -> the retried attempt resumes with --resume."""
    import shutil

    pytest.importorskip("torch")
    folder = tmp_path / "project"
    shutil.copytree(OWN_CODE, folder)
    raw = spec(tmp_path, ["python", "ddp.py"])
    raw["job"] |= {
        "workdir": str(folder),
        "launcher": "torchrun",
        "ranks_per_node": 1,
        "resume_args": ["--resume"],
    }
    raw["env"] = {"PREEMPT_ONCE": "1"}
    raw["retry"] = {"run": {"retries": 1, "delay_s": 0}}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    cluster = state.result().cluster
    outputs = Path(state.result().artifacts_dir) / "outputs"
    ranks = [json.loads((outputs / f"rank-{r}.json").read_text()) for r in (0, 1)]
    address = cluster.rendezvous.rpartition(":")[0]
    for number, seen in enumerate(ranks):
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["GPUFLOW_NODE_RANK"]) == (
            str(number), "0", str(number),
        )  # fmt: skip
        assert (seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"]) == ("2", "1")
        assert seen["GPUFLOW_MASTER_ADDR"] == address
        assert seen["GPUFLOW_NODE_ADDRS"] == ",".join(cluster.node_addresses)
        assert (seen["sum"], seen["argv"], seen["GPUFLOW_ATTEMPT"]) == (3.0, ["--resume"], "2")
    assert sorted(p.name for p in outputs.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-1"]
    assert gpuflow_jobs() == []
