"""Work units per job kind: the table of what each kind hands a backend. Pure: no Prefect,
no processes."""

from __future__ import annotations

import json
import sys
import types
from datetime import UTC, datetime

import pytest

from gpuflow.tasks.backends.registry import get_backend
from gpuflow.tasks.contract import Cluster
from gpuflow.tasks.kinds.registry import get_kind
from gpuflow.tasks.kinds.render import units_for
from gpuflow.tasks.render.frames import blender_frames
from gpuflow.tasks.render.scene import RenderPlan, SceneInfo
from gpuflow.tasks.spec import load_spec

TRAIN = {"kind": "train", "dataset": "file:///data", "output": "file:///models"}


def cluster(nodes: int = 1, gpus: int = 0, backend: str = "local", **extra) -> Cluster:
    names = [f"node-{i}" for i in range(nodes)]
    return Cluster(
        backend=backend,
        capabilities=get_backend(backend).capabilities,
        name="gpuflow-units",
        owner={},
        hostname="node-0",
        workspace="/tmp/gpuflow-units",
        gpu_indices=list(range(gpus)),
        nodes=nodes,
        node_names=names,
        created_at=datetime.now(UTC),
        **extra,
    )


def render_plan(frames: list[int]) -> RenderPlan:
    info = SceneInfo(
        blender="Blender 4.0",
        scene="Scene",
        frame_start=frames[0],
        frame_end=frames[-1],
        engine="CYCLES",
        camera="Camera",
        resolution=[64, 64],
        file_format="PNG",
        load_s=1.0,
    )
    return RenderPlan(
        blend="/scenes/shot.blend", info=info, frames=frames, file_format="PNG", extension="png",
        engine="CYCLES",
    )  # fmt: skip


@pytest.mark.parametrize(
    "frames, chunk, gpus, workers, expected",
    [
        (range(1, 11), 3, 0, None, [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]),
        (range(1, 11), 5, 2, None, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]),
        (range(1, 4), 1, 1, 2, [[1], [2], [3]]),
        ([1, 5, 9], 10, 0, None, [[1, 5, 9]]),
    ],
)
def test_render_chunks_are_units_with_their_frames(frames, chunk, gpus, workers, expected):
    job = {"kind": "render", "scene": "/scenes/shot.blend", "output": "file:///out", "chunk": chunk}
    if workers:
        job["max_workers"] = workers
    spec = load_spec({"job": job, "resources": {"gpus": gpus, "allow_cpu": True}})
    units = units_for(spec, cluster(gpus=gpus), render_plan(list(frames)))
    assert [u.frames for u in units] == expected
    assert all(u.frames and u.launcher is None for u in units)
    assert [u.name for u in units] == [f"chunk-{i}" for i in range(len(expected))]
    for unit in units:  # Blender gets exactly the unit's frames
        assert unit.command[unit.command.index("-f") + 1] == blender_frames(unit.frames)
    held = [u.gpus for u in units]
    if gpus:  # one GPU per chunk, taken in turn
        assert held == [[i % gpus] for i in range(len(units))]
    else:
        assert held == [[]] * len(units)


def test_render_chunks_spread_over_nodes():
    spec = load_spec(
        {
            "job": {"kind": "render", "scene": "/s.blend", "output": "file:///o", "chunk": 2},
            "resources": {"gpus": 1},
        }
    )
    units = units_for(spec, cluster(nodes=2, gpus=1), render_plan(list(range(1, 9))))
    assert [(u.node, u.gpus) for u in units] == [(0, [0]), (1, [0]), (0, [0]), (1, [0])]


def test_render_chunks_in_pods_run_the_chunk_program_with_no_path_of_this_host():
    """On Kubernetes a chunk is the pod's chunk program: the scene and output as storage
    URLs, the chunk's frames and Blender's settings; nothing of the flow's host (its
    scratch folder, its fetched .blend) is in the command."""
    import json

    from gpuflow.tasks.render.pod_chunk import PodChunk

    spec = load_spec(
        {
            "job": {
                "kind": "render",
                "scene": "s3://scenes/shot.zip",
                "blend": "shot/main.blend",
                "output": "s3://frames/shot",
                "chunk": 3,
                "samples": 16,
            },
            "resources": {"gpus": 1},
            "placement": {"backend": "kubernetes"},
        }
    )
    units = units_for(spec, cluster(gpus=2, backend="kubernetes"), render_plan(list(range(1, 8))))
    assert [u.frames for u in units] == [[1, 2, 3], [4, 5, 6], [7]]
    assert [u.gpus for u in units] == [[0], [1], [0]]
    for index, unit in enumerate(units):
        assert unit.command[:4] == [
            sys.executable,
            "-m",
            "gpuflow.tasks.render.pod_chunk",
            "--chunk-json",
        ]
        chunk = PodChunk.model_validate_json(unit.command[4])
        assert (chunk.scene, chunk.blend, chunk.output) == (
            "s3://scenes/shot.zip",
            "shot/main.blend",
            "s3://frames/shot",
        )
        assert (chunk.frames, chunk.index, chunk.settings.samples) == (unit.frames, index, 16)
        assert chunk.pattern == "frame_####"
        assert "/tmp/gpuflow-units" not in json.dumps(unit.command)


def test_train_runs_one_unit_per_node_meeting_at_one_rendezvous():
    spec = load_spec({"name": "big", "job": TRAIN, "resources": {"gpus": 4}})
    units = get_kind("train").units(spec, cluster(nodes=2, gpus=4, rendezvous="node-0:29400"))
    assert [u.node for u in units] == [0, 1]
    assert {u.world_size for u in units} == {8}
    argvs = [u.command for u in units]
    assert [a[a.index("--node-rank") + 1] for a in argvs] == ["0", "1"]
    assert {a[a.index("--rendezvous") + 1] for a in argvs} == {"node-0:29400"}
    assert {a[a.index("--nnodes") + 1] for a in argvs} == {"2"}
    assert argvs[0][:3] == [sys.executable, "-m", "gpuflow.tasks.training.launch"]
    assert {a[a.index("--stop-grace-s") + 1] for a in argvs} == {"30"}  # limits.stop_grace_s


def test_torchrun_waits_the_jobs_stop_grace_for_its_ranks(monkeypatch, tmp_path):
    """torchrun SIGKILLs its ranks 30 s after its SIGTERM by default: launch hands it the
    job's limits.stop_grace_s, so a longer grace is the ranks' to write their checkpoint."""
    from gpuflow.tasks.training import launch

    started: dict = {}

    class Torchrun:  # what launch starts, as the process boundary sees it
        def __init__(self, command: list[str], env: dict[str, str]) -> None:
            started.update(command=command, env=env)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(launch, "subprocess", types.SimpleNamespace(Popen=Torchrun))
    monkeypatch.setattr(launch.signal, "signal", lambda *_: None)  # this process's own
    monkeypatch.setenv("GPUFLOW_WORKSPACE", str(tmp_path))
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    spec = load_spec({"job": {**TRAIN, "cpu_processes": 1}, "limits": {"stop_grace_s": 120}})
    [unit] = get_kind("train").units(spec, cluster())
    args = unit.command[unit.command.index("--job-json") :]
    assert launch.main(args) == 0
    assert "torch.distributed.run" in started["command"]
    assert started["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"


def test_train_on_one_node_is_standalone():
    spec = load_spec({"job": {**TRAIN, "cpu_processes": 2}})
    [unit] = get_kind("train").units(spec, cluster())
    assert unit.world_size == 2 and "--rendezvous" not in unit.command


def test_torchrun_options_for_one_node_and_many():
    from gpuflow.tasks.training.launch import rendezvous_args

    assert rendezvous_args(1, 0, None, "r") == ["--standalone"]
    assert rendezvous_args(2, 1, "node-0:29400", "r") == [
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node-0:29400",
        "--rdzv_id=r",
        "--rdzv_conf=is_host=false",
    ]
    # node 0 serves the rendezvous, whatever its host name resolves to
    assert rendezvous_args(2, 0, "node-0:29400", "r")[-1] == "--rdzv_conf=is_host=true"
    # and its workers' store is at its address as the others reach it, not its host name
    assert rendezvous_args(2, 0, "10.0.0.5:29400", "r", "10.0.0.5")[-1] == "--local_addr=10.0.0.5"


def test_hpc_is_one_launcher_over_the_hosts_slots():
    spec = load_spec({"job": {"kind": "hpc", "ranks": 8, "slots": 4, "program": ["./sim"]}})
    [unit] = get_kind("hpc").units(spec, cluster(nodes=2))
    assert unit.name == "launcher" and unit.launcher is not None and unit.node == 0
    assert unit.launcher.hostfile == "node-0 slots=4\nnode-1 slots=4\n"
    assert unit.launcher.hosts() == [("node-0", 4), ("node-1", 4)]
    hosts = json.loads(unit.command[unit.command.index("--hosts-json") + 1])
    assert [(h["name"], h["slots"]) for h in hosts] == [("node-0", 4), ("node-1", 4)]


def test_hpc_slots_follow_gpus_per_rank():
    spec = load_spec(
        {"job": {"kind": "hpc", "ranks": 4, "gpus_per_rank": 2, "md": {}}, "resources": {"gpus": 4}}
    )
    [unit] = get_kind("hpc").units(spec, cluster(nodes=2, gpus=4))
    assert unit.launcher.hostfile == "node-0 slots=2\nnode-1 slots=2\n"


@pytest.mark.parametrize("kind", ["command", "matmul"])
def test_single_command_kinds_are_one_unit_on_every_gpu(kind):
    job = {"kind": kind, "command": ["echo", "hi"]} if kind == "command" else {"kind": kind}
    [unit] = get_kind(kind).units(load_spec({"job": job}), cluster(gpus=2))
    assert unit.node == 0 and unit.gpus is None and unit.launcher is None and not unit.frames
    assert unit.command[:1] == (["echo"] if kind == "command" else [sys.executable])


@pytest.mark.parametrize(
    "copies, nodes, gpus, expected",
    [
        ("per_node", 2, 4, [(0, None), (1, None)]),
        ("per_gpu", 1, 2, [(0, [0]), (0, [1])]),
        ("per_gpu", 2, 2, [(0, [0]), (0, [1]), (1, [0]), (1, [1])]),
        ("per_gpu", 2, 0, [(0, []), (1, [])]),  # no GPU here (allow_cpu): a copy a node
    ],
)
def test_command_copies_are_one_unit_per_node_or_per_gpu(copies, nodes, gpus, expected):
    spec = load_spec(
        {
            "job": {"kind": "command", "command": "echo hi", "copies": copies},
            "resources": {"gpus": max(gpus, 1), "nodes": nodes, "allow_cpu": True},
        }
    )
    units = get_kind("command").units(spec, cluster(nodes=nodes, gpus=gpus))
    assert [(u.node, u.gpus) for u in units] == expected
    assert [u.name for u in units] == [f"task-{i}" for i in range(len(expected))]
    assert [u.env for u in units] == [
        {"GPUFLOW_TASK_INDEX": str(i), "GPUFLOW_TASKS": str(len(expected))}
        for i in range(len(expected))
    ]
    assert all(u.command == ["echo", "hi"] and u.launcher is None for u in units)


def test_command_copies_per_gpu_needs_gpus():
    from gpuflow.tasks.errors import InvalidSpec

    spec = load_spec({"job": {"kind": "command", "command": "echo hi", "copies": "per_gpu"}})
    with pytest.raises(InvalidSpec, match=r"^job.copies: per_gpu .* resources.gpus is 0"):
        get_kind("command").check(spec, get_backend("local").capabilities)
