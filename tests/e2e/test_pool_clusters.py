"""One pool over the real test clusters: the Kubernetes test cluster (KWOK GPU nodes),
the Slurm test cluster, and EC2 on moto with the metadata mock. A full candidate fails
over to the next and keeps nothing; the policy picks from the offers; a job preempted on
EC2 spot resumes on the next candidate from what it saved in storage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import artifacts_of, events_named, logs_of

pytestmark = pytest.mark.e2e

L4 = "NVIDIA-L4"
# what pool runs with a local candidate ask for: that candidate needs it free on this machine
POOL_DISK = "8Gi"
BLOCKER = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "pool-l4-blocker"},  # owned by no Job: the testbed keeps it running
    "spec": {
        "nodeSelector": {"nvidia.com/gpu.product": L4},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "containers": [
            {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "4"}}}
        ],
    },
}


def rows_of(run_id: str) -> dict[str, dict]:
    """Return the run's last placement table, by candidate."""
    data = latest(run_id, "gpuflow-placement").data
    return {r["candidate"]: r for r in (json.loads(data) if isinstance(data, str) else data)}


def latest(run_id: str, key: str):
    """Return the newest artifact `key` of the run (a table published again as it changed)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        [newest, *_] = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(run_id))])),
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
        )
    return newest


@pytest.fixture
def l4_taken(kube):
    """Every L4 GPU of the Kubernetes test cluster, held by a pod of someone else."""
    kube.request("POST", "/api/v1/namespaces/default/pods", BLOCKER)
    yield
    kube.request(
        "DELETE", "/api/v1/namespaces/default/pods/pool-l4-blocker", {"gracePeriodSeconds": 0}
    )


def k8s_then_slurm(tmp_path: Path, **sections) -> dict:
    return {
        "name": "pool-l4",
        "job": {"kind": "command", "command": ["echo", "hello from the pool"]},
        "resources": {"gpus": 1, "gpu_product": "L4"},
        "limits": {"max_duration": "10m"},
        "placement": [
            {"backend": "kubernetes", "gpu_wait": "3s"},
            {
                "backend": "slurm",
                "partition": "l4",
                "workspace_root": str(tmp_path / "workspaces"),
                "price_table": "pool-site",
            },
        ],
        **sections,
    }


@pytest.fixture
def site_prices(prefect_api):
    """The Slurm cluster's GPUs at $2/h; Kubernetes' at the table's (free)."""
    from gpuflow.blocks.prices import GpuPriceTable

    GpuPriceTable(gpu_hourly_usd={"slurm": {"*": 2.0}}).save("pool-site", overwrite=True)


def test_pool_kubernetes_full_fails_over_to_slurm_and_leaves_nothing_there(
    kube, slurm, l4_taken, site_prices, prefect_api, gpuflow_home, tmp_path
):
    """Kubernetes first, its L4 GPUs all taken by another pod: its unit waits its
    gpu_wait (3 s), the candidate is given up and what it made removed, and the job runs
    on the Slurm cluster's L4 partition; the table and the events say why."""
    from tests.e2e.test_kubernetes import wait_gone
    from tests.e2e.test_slurm import gpuflow_jobs

    state = gpu_pipeline(load_spec(k8s_then_slurm(tmp_path)), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    run_id = result.flow_run_id
    assert result.cluster.backend == "slurm"
    rows = rows_of(run_id)
    k8s, slurm_row = rows["[0] kubernetes"], rows["[1] slurm/l4"]
    assert k8s["verdict"] == "given up" and k8s["can_start_now"] == "no"
    assert "0 GPU(s) free on 1 node(s)" in k8s["why_not"]
    assert "not placed within 3 s (placement.gpu_wait)" in k8s["reason"]
    assert slurm_row["verdict"] == "chosen" and slurm_row["usd_per_hour"] == 2.0
    assert slurm_row["gpus_free_now"] == "2 x NVIDIA-L4"
    logs = logs_of(run_id)
    assert any(line.startswith("failover: kubernetes gave up") for line in logs), logs
    assert any("hello from the pool" in line for line in logs)
    [failover] = events_named("gpuflow.placement.failover", f"gpuflow.run.{run_id}")
    assert failover["payload"]["next"] == "slurm/l4"
    assert wait_gone(kube, run_id) == []  # nothing of this run is left on Kubernetes
    assert gpuflow_jobs() == []
    assert result.metrics.by_placement[-1]["candidate"] == "slurm/l4"


def test_pool_soonest_skips_a_full_candidate_and_cheapest_takes_a_free_one(
    kube, slurm, site_prices, prefect_api, gpuflow_home, tmp_path
):
    """soonest: Kubernetes (free but full) is listed first, Slurm ($2/h) can start now:
    the job starts on Slurm and Kubernetes is not even tried. cheapest, once Kubernetes
    has room: the free candidate over the $2/h one."""
    from tests.e2e.test_kubernetes import wait_gone

    kube.request("POST", "/api/v1/namespaces/default/pods", BLOCKER)
    try:
        raw = k8s_then_slurm(tmp_path, placement_policy={"choose": "soonest"})
        soonest = gpu_pipeline(load_spec(raw), return_state=True)
    finally:
        kube.request(
            "DELETE",
            "/api/v1/namespaces/default/pods/pool-l4-blocker",
            {"gracePeriodSeconds": 0},
        )
    assert soonest.is_completed(), soonest.message
    assert soonest.result().cluster.backend == "slurm"
    rows = rows_of(soonest.result().flow_run_id)
    assert rows["[0] kubernetes"]["verdict"] == "not needed"
    assert rows["[0] kubernetes"]["can_start_now"] == "no"
    assert rows["[1] slurm/l4"]["verdict"] == "chosen"
    assert {r["policy"] for r in rows.values()} == {"soonest"}
    _wait_free(kube)
    raw = k8s_then_slurm(tmp_path, placement_policy={"choose": "cheapest"})
    raw["placement"] = raw["placement"][::-1]  # listed last, still chosen: it is cheaper
    cheapest = gpu_pipeline(load_spec(raw), return_state=True)
    assert cheapest.is_completed(), cheapest.message
    assert cheapest.result().cluster.backend == "kubernetes"
    rows = rows_of(cheapest.result().flow_run_id)
    assert rows["[1] kubernetes"]["verdict"] == "chosen"
    assert rows["[1] kubernetes"]["usd_per_hour"] == 0.0
    assert rows["[0] slurm/l4"]["verdict"] == "not needed"
    assert rows["[0] slurm/l4"]["usd_per_hour"] == 2.0
    assert wait_gone(kube, cheapest.result().flow_run_id) == []


def _wait_free(kube, seconds: float = 60) -> None:
    """Return once no pod holds the L4 node's GPUs (the blocker's deletion takes effect)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pods = kube.request("GET", "/api/v1/namespaces/default/pods").get("items", [])
        if not any(p["metadata"]["name"] == "pool-l4-blocker" for p in pods):
            return
        time.sleep(0.2)
    pytest.fail("the blocker pod was not deleted within 60 s")


@pytest.mark.timeout(600)  # two trainings on CPU and an instance
def test_pool_training_preempted_on_ec2_spot_resumes_on_the_next_candidate_bitwise(
    aws, played, s3_server, prefect_api, gpuflow_home
):
    """Training on an EC2 spot instance gets a spot notice at its step 6:
    the pool moves it to the next candidate (this machine), which resumes from the
    checkpoint in S3; the final weights equal an uninterrupted run's, and the summary
    splits GPU-hours and cost between the two, the spot instance at its spot price."""
    from gpuflow.tasks.storage import S3Store
    from tests.e2e.test_ec2 import (
        RESUME_JOB,
        left_of,
        pipeline_while,
        resume_dataset,
        spot_notice_at_step,
        straight_weights,
        torch_equal,
        train_on_ec2,
    )
    from tests.e2e.test_training import _weights

    a = straight_weights(s3_server)
    raw = train_on_ec2(resume_dataset(s3_server), s3_server.url("runs/pool-spot"), **RESUME_JOB)
    spot = {**raw["placement"], "market": "spot"}
    raw["placement"] = [spot, {"backend": "local"}]
    # this machine has no GPU; the local candidate checks its free disk: ask for little
    raw["resources"] = {**raw["resources"], "allow_cpu": True, "disk": POOL_DISK}
    interrupted: list[str] = []
    reclaim = spot_notice_at_step(played, 6, interrupted)
    state, run_id = pipeline_while(raw, reclaim)
    result = state.result()
    assert interrupted and result.cluster.backend == "local"
    assert len(played.instances) == 1  # not retried on EC2: moved on
    logs = "\n".join(logs_of(run_id))
    assert "failover: ec2/gpuflow-test-fleet spot was preempted; the job resumes on local" in logs
    assert "resumed from checkpoint step" in logs
    b = _weights(S3Store(s3_server.settings()), result.metrics.job["weights"])
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    split = result.metrics.by_placement
    assert [(r["backend"], r["ended"]) for r in split] == [
        ("ec2", "preempted"),
        ("local", "completed"),
    ]
    offer = spot_offer(aws, interrupted[0])
    assert split[0]["usd_per_hour"] == pytest.approx(offer, abs=1e-4)  # the spot price paid
    assert split[0]["gpu_hours"] > 0 and split[0]["cost_usd"] > 0
    assert result.metrics.cost_usd == pytest.approx(sum(r["cost_usd"] for r in split))
    rows = rows_of(run_id)
    assert rows["[0] ec2/gpuflow-test-fleet spot"]["verdict"] == "preempted"
    assert rows["[1] local"]["verdict"] == "chosen"
    summary = str(artifacts_of(run_id)["gpuflow-summary"].data)
    assert "on ec2/gpuflow-test-fleet spot (preempted)" in summary
    assert not any(left_of(aws, s3_server, run_id).values())


def spot_offer(aws: dict, instance_id: str) -> float:
    """Return the hourly price gpuflow's catalog gives the instance's type in its zone,
    spot, with its root volume (what the offer it was launched from said)."""
    from gpuflow.tasks.backends.ec2.catalog import find_offers
    from gpuflow.tasks.metrics.cost import PriceTable
    from tests.e2e.conftest import FLEET

    [reservation] = aws["ec2"].describe_instances(InstanceIds=[instance_id])["Reservations"]
    instance = reservation["Instances"][0]
    spec = load_spec(
        {
            "job": {"kind": "command", "command": ["true"]},
            "resources": {"gpus": 1, "gpu_product": "L4", "disk": POOL_DISK},
            "placement": {"backend": "ec2", "block": FLEET, "market": "spot"},
        }
    )
    _, offers = find_offers(spec, PriceTable())
    [offer] = [
        o
        for o in offers
        if o.instance_type == instance["InstanceType"]
        and o.zone == instance["Placement"]["AvailabilityZone"]
    ]
    return offer.hourly_usd


def test_pool_a_render_preempted_on_ec2_spot_renders_only_the_missing_frames_elsewhere(
    aws, played, s3_server, prefect_api, gpuflow_home, tmp_path
):
    """A render on an EC2 spot instance gets a spot notice once its first frame is in
    storage: the rest render on the next candidate (this machine's Blender), and no frame
    is uploaded twice (the bucket keeps every version of every object)."""
    import shutil as sh

    from gpuflow.tasks.render.scene import demo_scene
    from gpuflow.tasks.storage import store_for
    from tests.e2e.test_ec2 import interrupt_when, left_of, pipeline_while, spec

    blender = sh.which("blender")
    assert blender, "blender is not installed; the test command installs it"
    s3 = aws["s3"]
    s3.create_bucket(Bucket="pool-frames")
    s3.put_bucket_versioning(Bucket="pool-frames", VersioningConfiguration={"Status": "Enabled"})
    scene = "s3://pool-frames/scenes/cube.blend"
    store = store_for(scene, s3_server.settings())
    # each frame takes about 2 s: the one chunk of 8 frames is still rendering seconds after
    # its first frame is in storage, longer than the agent takes to see a notice (5 s)
    slow = "bpy.context.scene.cycles.samples = 2048\nbpy.context.scene.cycles.use_adaptive_sampling = False"
    store.upload_file(scene, demo_scene(blender, tmp_path / "cube.blend", 8, 64, slow))
    output = "s3://pool-frames/renders/cube"
    raw = spec([])
    raw["job"] = {"kind": "render", "scene": scene, "output": output, "chunk": 8, "device": "CPU"}
    raw["resources"] = {"gpus": 1, "gpu_product": "L4", "disk": POOL_DISK, "allow_cpu": True}
    raw["metrics"] = {"plot": False}
    raw["placement"] = [{**raw["placement"], "market": "spot"}, {"backend": "local"}]
    struck: list[str] = []

    def frames_in_storage() -> int:
        listed = s3.list_objects_v2(Bucket="pool-frames", Prefix="renders/cube/")
        return sum(o["Key"].endswith(".png") for o in listed.get("Contents", []))

    reclaim = interrupt_when(played, lambda: frames_in_storage() >= 1, struck)
    state, run_id = pipeline_while(raw, reclaim)
    assert struck and state.result().cluster.backend == "local"
    versions = s3.list_object_versions(Bucket="pool-frames", Prefix="renders/cube/")
    frames = [v["Key"] for v in versions.get("Versions", []) if v["Key"].endswith(".png")]
    assert sorted(frames) == [f"renders/cube/frame_{i:04d}.png" for i in range(1, 9)]
    job = state.result().metrics.job
    assert job["frames_skipped"] >= 1 and job["frames_missing"] == 0
    assert job["frames_skipped"] + job["frames_rendered"] == 8
    logs = "\n".join(logs_of(run_id))
    assert "was preempted; the job resumes on local" in logs
    assert not any(left_of(aws, s3_server, run_id).values())
