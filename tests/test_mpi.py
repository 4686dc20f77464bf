"""Open MPI launch lines and layout checks, table-driven."""

from __future__ import annotations

import pytest

from gpuflow.tasks.hpc.mpi import (
    Host,
    LayoutError,
    check_layout,
    exported,
    hostfile,
    mpirun_argv,
    place,
)
from gpuflow.tasks.hpc.rank import local_gpus

TWO = [Host(name="server1", slots=2, gpus=2), Host(name="server2", slots=2, gpus=2)]


def test_the_seed_command_line():
    argv = mpirun_argv(
        ["python", "train.py"], 4, TWO, ["LD_LIBRARY_PATH", "NCCL_DEBUG"], as_root=False
    )
    assert argv == [
        "mpirun", "-np", "4", "-H", "server1:2,server2:2", "--bind-to", "none",
        "--map-by", "slot", "-x", "LD_LIBRARY_PATH", "-x", "NCCL_DEBUG", "python", "train.py",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("as_root", "oversubscribe", "present", "absent"),
    [
        (True, False, ["--allow-run-as-root"], ["--oversubscribe"]),
        (False, True, ["--oversubscribe"], ["--allow-run-as-root"]),
        (False, False, [], ["--allow-run-as-root", "--oversubscribe"]),
    ],
)
def test_root_and_oversubscribe_only_when_needed(as_root, oversubscribe, present, absent):
    argv = mpirun_argv(["prog"], 2, None, [], as_root=as_root, oversubscribe=oversubscribe)
    assert all(flag in argv for flag in present) and not any(flag in argv for flag in absent)
    assert argv[-1] == "prog" and "-H" not in argv


def test_hostfile_and_path():
    assert hostfile(TWO) == "server1 slots=2\nserver2 slots=2\n"
    argv = mpirun_argv(["prog"], 4, TWO, [], as_root=False, hostfile_path="/ws/hosts")
    assert argv[3:5] == ["--hostfile", "/ws/hosts"] and "-H" not in argv


def test_exported_names_never_values():
    env = {
        "NCCL_DEBUG": "INFO",
        "LD_LIBRARY_PATH": "/x",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "HOME": "/root",
    }
    assert exported(env, ["CUDA_VISIBLE_DEVICES"]) == [
        "CUDA_VISIBLE_DEVICES",
        "LD_LIBRARY_PATH",
        "NCCL_DEBUG",
    ]
    argv = mpirun_argv(["prog"], 1, None, exported(env), as_root=False)
    assert "s3cr3t" not in " ".join(argv) and "INFO" not in argv


@pytest.mark.parametrize(
    ("ranks", "hosts", "placed"),
    [
        (4, TWO, [2, 2]),
        (3, TWO, [2, 1]),
        (1, TWO, [1, 0]),
        (6, TWO, [3, 3]),  # oversubscribed: round again
        (5, [Host(name="a", slots=1)], [5]),
    ],
)
def test_place_maps_by_slot(ranks, hosts, placed):
    assert place(ranks, hosts) == placed


BAD = [
    (0, TWO, 0, False, "ranks must be at least 1"),
    (
        5,
        TWO,
        0,
        False,
        "job.ranks: 5 ranks do not fit in 4 slot(s); lower job.ranks, add slots or hosts, or set job.oversubscribe: true",
    ),
    (2, [], 0, False, "job.hosts is empty"),
    (
        4,
        TWO,
        2,
        False,
        "job.gpus_per_rank: 2 rank(s) x 2 GPU(s) on server1 need 4 GPUs but it has 2",
    ),
]


@pytest.mark.parametrize(("ranks", "hosts", "gpus", "over", "message"), BAD)
def test_bad_layouts(ranks, hosts, gpus, over, message):
    with pytest.raises(LayoutError) as caught:
        check_layout(ranks, hosts, gpus, over)
    assert message in str(caught.value)


def test_good_layouts_pass():
    check_layout(4, TWO, 1)
    check_layout(6, TWO, 0, oversubscribe=True)


@pytest.mark.parametrize(
    ("local_rank", "per_rank", "visible", "owned"),
    [
        (0, 1, ["0", "1"], ["0"]),
        (1, 1, ["0", "1"], ["1"]),
        (1, 2, ["4", "5", "6", "7"], ["6", "7"]),
    ],
)
def test_local_gpus(local_rank, per_rank, visible, owned):
    assert local_gpus(local_rank, per_rank, visible) == owned


def test_local_gpus_too_few():
    with pytest.raises(ValueError, match="local rank 2 needs GPUs 2-2 but only 2 are visible"):
        local_gpus(2, 1, ["0", "1"])


def test_hosts_take_the_names_of_an_operators_hostfile_in_order():
    from gpuflow.tasks.hpc.mpi import renamed

    hosts = [Host(name="node-0", slots=4, gpus=4), Host(name="node-1", slots=4, gpus=4)]
    text = "md-mpi-worker-0.md-mpi.ml.svc slots=4\nmd-mpi-worker-1.md-mpi.ml.svc slots=4\n"
    assert [(h.name, h.slots, h.gpus) for h in renamed(hosts, text)] == [
        ("md-mpi-worker-0.md-mpi.ml.svc", 4, 4),
        ("md-mpi-worker-1.md-mpi.ml.svc", 4, 4),
    ]
    with pytest.raises(LayoutError, match="the hostfile names 1 host"):
        renamed(hosts, "a slots=4\n")
    with pytest.raises(LayoutError, match="gives b 2 slot"):
        renamed(hosts, "a slots=4\nb slots=2\n")
