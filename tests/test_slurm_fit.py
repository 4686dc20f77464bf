"""The Slurm backend's fit check: sinfo's rows read, and each request the cluster could
never run refused with one sentence naming the field and the fix. Pure: no Slurm."""

from __future__ import annotations

import pytest

from gpuflow.tasks.backends.slurm.fit import Request, parse_sinfo, refusal

# as `sinfo -h -N -o '%P|%N|%G|%l'` prints the test cluster
SINFO = """\
gpu*|g1|gpu:h100:4(S:0)|1:00:00
gpu*|g2|gpu:h100:4(S:0)|1:00:00
l4|l1|gpu:l4:2|1:00:00
urgent|g1|gpu:h100:4(S:0)|infinite
urgent|g2|gpu:h100:4(S:0)|infinite
urgent|l1|gpu:l4:2|infinite
cpu|c1|(null)|2-00:00:00
"""


def test_sinfo_rows_are_read():
    rows = parse_sinfo(SINFO)
    g1 = rows[0]
    assert (g1.partition, g1.default, g1.node, g1.gpus, g1.max_minutes) == (
        "gpu", True, "g1", {"h100": 4}, 60
    )  # fmt: skip
    assert rows[2].gpus == {"l4": 2} and not rows[2].default
    assert rows[3].max_minutes is None and rows[6].max_minutes == 2880 and rows[6].gpus == {}


def ask(partition=None, nodes=1, gpus=1, kind="h100", minutes=30) -> Request:
    return Request(partition=partition, nodes=nodes, gpus=gpus, gres_type=kind, minutes=minutes)


@pytest.mark.parametrize(
    ("request_", "said"),
    [
        (ask(), None),
        (ask(nodes=2, gpus=4), None),
        (ask(partition="l4", kind="l4", gpus=2), None),
        (ask(partition="urgent", minutes=10_000), None),
        (ask(kind=None, gpus=3), None),
        (ask(partition="cpu", gpus=0), None),
        (
            ask(partition="a100"),
            "placement.partition: 'a100' is not a partition of this Slurm cluster; use one of:"
            " cpu, gpu, l4, urgent.",
        ),
        (
            ask(gpus=8),
            "resources.gpus: the job needs 8 x gpu:h100 on one node; the largest node in"
            " partition gpu has 4; lower resources.gpus or use 2 nodes.",
        ),
        (
            ask(gpus=8, nodes=2),
            "resources.gpus: the job needs 8 x gpu:h100 on one node; the largest node in"
            " partition gpu has 4; lower resources.gpus.",
        ),
        (
            ask(kind="a100"),
            "resources.gpu_product: no node of partition gpu has gpu:a100 (it has gpu:h100);"
            " ask for a product it has, or another partition.",
        ),
        (
            ask(nodes=3, gpus=4),
            "resources.nodes: the job needs 3 nodes with 4 x gpu:h100; partition gpu has 2;"
            " lower resources.nodes or use another partition.",
        ),
        (
            ask(partition="cpu", gpus=0, nodes=2),
            "resources.nodes: the job needs 2 nodes; partition cpu has 1; lower"
            " resources.nodes or use another partition.",
        ),
        (
            ask(minutes=61),
            "limits.max_duration: with its grace the allocation needs 61 min, and partition"
            " gpu allows 60 min; lower limits.max_duration or use another partition.",
        ),
        (
            ask(partition="cpu"),
            "resources.gpu_product: no node of partition cpu has gpu:h100 (it has no typed"
            " GPUs); ask for a product it has, or another partition.",
        ),
    ],
)
def test_what_the_cluster_could_never_run_is_said_with_its_fix(request_, said):
    assert refusal(request_, parse_sinfo(SINFO)) == said


def test_a_cluster_without_a_default_partition_asks_for_one():
    rows = parse_sinfo("gpu|g1|gpu:h100:4|60\n")
    assert refusal(ask(), rows) == (
        "placement.partition: the Slurm cluster has no default partition; name one of: gpu."
    )


def test_idle_gpus_count_what_up_nodes_have_free():
    from gpuflow.tasks.backends.slurm.fit import idle_gpus

    rows = (
        "g1   gpu:h100:4   gpu:h100:2(IDX:0-1)   mix\n"
        "g2   gpu:h100:4   gpu:h100:0(IDX:N/A)   idle\n"
        "g3   gpu:h100:4   gpu:h100:0(IDX:N/A)   down*\n"
        "g4   gpu:h100:4   gpu:h100:4(IDX:0-3)   alloc\n"
        "l1   gpu:l4:2     gpu:l4:0(IDX:N/A)     idle~\n"
    )
    assert idle_gpus(rows) == {"h100": 6, "l4": 2}


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (
            "ReqNodeNotAvail, UnavailableNodes:g[1-2]",
            "nodes it needs are down, drained or reserved (UnavailableNodes:g[1-2]); wait for",
        ),
        (
            "PartitionNodeLimit",
            "partition gpu allows fewer nodes per job than the 2 node(s) x gpu:h100:4 asked"
            " for; lower resources.nodes or use another partition",
        ),
        ("PartitionTimeLimit", "partition gpu allows less time than the allocation asks"),
        ("PartitionDown", "partition gpu is down; wait until its administrators bring it up"),
        (
            "QOSMaxGRESPerUser",
            "the QOS allows you fewer GPUs than 2 node(s) x gpu:h100:4 while your other jobs",
        ),
        ("AssocGrpGRES", "your account's GPU limit is used up by its running jobs;"),
        ("BadConstraints", "no node has the features and resources asked for"),
        ("InvalidAccount", "set the SlurmCluster block's account to one of yours"),
        ("InvalidQOS", "set the SlurmCluster block's qos to one it has"),
        ("SomethingNew", "Slurm holds the job with reason SomethingNew"),
    ],
)
def test_each_pending_reason_that_waiting_will_not_clear_is_said_with_its_fix(reason, said):
    from gpuflow.tasks.backends.slurm.fit import pending_reason

    request = Request(partition="gpu", nodes=2, gpus=4, gres_type="h100", minutes=30)
    assert said in pending_reason(reason, request, "gpu")


CONFIG = """\
AccountingStorageHost   = localhost
AccountingStorageType   = {plugin}
AccountingStorageUser   = root
"""


@pytest.mark.parametrize(
    ("plugin", "known", "said"),
    [
        ("accounting_storage/none", None, "qos: the Slurm cluster keeps no accounting"
         " (accounting_storage/none), so it has no QOS and would ignore 'gold'; remove qos"),
        ("accounting_storage/slurmdbd", ["normal", "urgent"], "qos: the Slurm cluster has no"
         " QOS 'gold'; use one of: normal, urgent (`sacctmgr show qos`)."),
        ("accounting_storage/slurmdbd", [], "use one of: none (`sacctmgr show qos`)."),
        ("accounting_storage/slurmdbd", ["gold", "normal"], None),
        ("accounting_storage/slurmdbd", None, None),  # sacctmgr could not say: sbatch will
    ],
)  # fmt: skip
def test_a_qos_the_cluster_lacks_is_one_sentence(plugin, known, said):
    from gpuflow.tasks.backends.slurm.fit import accounting, qos_refusal

    assert accounting(CONFIG.format(plugin=plugin)) == plugin
    got = qos_refusal("gold", plugin, known)
    if said is None:
        assert got is None
    else:
        assert got is not None and said in got, got


def test_threads_asking_slurm_at_once_share_one_answer_given_after_they_asked():
    """One squeue (or scontrol) answers every thread that asked while the one before it
    ran; a caller never gets an answer that began before it asked."""
    import subprocess
    import sys
    import threading
    import time

    from gpuflow.tasks.backends.slurm.queue import SharedAnswer, shared

    def waiting_for_an_answer() -> int:
        """Return how many threads are inside SharedAnswer.get (asked, not yet answered)."""
        inside = 0
        for frame in sys._current_frames().values():
            while frame is not None and frame.f_code is not SharedAnswer.get.__code__:
                frame = frame.f_back
            inside += frame is not None
        return inside

    class Client:
        calls = 0

        def answer(self, argv: list[str]) -> subprocess.CompletedProcess:
            Client.calls += 1
            began = time.monotonic()
            if Client.calls == 1:  # the first answer ends once all 8 have asked
                everyone.wait(timeout=60)
                until = time.monotonic() + 60
                while waiting_for_an_answer() < 8 and time.monotonic() < until:
                    time.sleep(0.01)  # a busy machine: the last ones are still on their way
            return subprocess.CompletedProcess(argv, 0, stdout=str(began), stderr="")

    cli = Client()
    asked: list[float] = []
    got: list[float] = []

    everyone = threading.Event()

    def ask() -> None:
        asked.append(time.monotonic())
        if len(asked) >= 8:
            everyone.set()
        got.append(float(shared(cli, ["squeue", "-h"]).stdout))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Client.calls == 2  # the first answer, and one for all who asked while it ran
    assert sorted(got)[1:] == [sorted(got)[1]] * 7
    before = Client.calls
    ask()
    assert Client.calls == before + 1 and got[-1] >= asked[-1]  # asked after: a new one
