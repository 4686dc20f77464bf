"""The backend contract: every backend passes the same tests through the same verbs —
local; Kubernetes on the test cluster (pods run by a played kubelet); EC2 on moto with its
instances booted here; Alibaba Cloud ECS and Tencent Cloud CVM on their fakes
(tests/fakes/alibaba_ecs.py, tencent_cvm.py) with their instances booted here; Slurm on the Slurm test cluster (scripts/slurm-testbed.sh); a fleet
host (scripts/fleet-testbed.sh); and `toy`, a backend defined in the test suite
(tests/e2e/toy_backend.py). A new backend proves itself by passing this suite:

    pytest -k contract

Each test asks the operating system or the backend's API what is left, never gpuflow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

import tests.e2e.toy_backend  # noqa: F401 - registers the toy backend
from gpuflow.tasks.backends import registry
from gpuflow.tasks.backends.base import Backend
from gpuflow.tasks.backends.registry import get_backend
from gpuflow.tasks.contract import RUN_LABEL, WorkUnit, owner_labels
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.spec import JobSpec, load_spec
from tests.conftest import subprocess_env
from tests.e2e.kubelet import NAMESPACE as KUBELET_NS
from tests.e2e.kubelet import PlayedKubelet

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
# the test cluster and the Slurm test cluster are one per session: their tests share a worker
SHARED_BEDS = {"kubernetes": "kubernetes", "slurm": "slurm"}
# every registered backend (the toy one included): one with no test bed below fails, named
BACKENDS = [
    pytest.param(name, marks=pytest.mark.xdist_group(SHARED_BEDS[name]))
    if name in SHARED_BEDS
    else name
    for name in registry.names()
]
LINES = 300
# Prints its lines, then waits; on SIGTERM it says so and exits 75 (state saved).
STOPPABLE = (
    "import os, pathlib, signal, sys, time\n"
    "def saved(*_):\n"
    "    out = pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR'])\n"
    "    (out / 'checkpoint.txt').write_text('saved on SIGTERM')\n"
    "    print('stopped cleanly', flush=True); sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, saved)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
# A killed orchestrator: provisions, starts a unit that runs for long, and is then killed.
ORCHESTRATOR = (
    "import json, sys\n"
    "import tests.e2e.toy_backend\n"
    "from gpuflow.tasks.kinds import registry\n"
    "from gpuflow.tasks.backends.registry import get_backend\n"
    "from gpuflow.tasks.contract import WorkUnit, owner_labels\n"
    "from gpuflow.tasks.spec import load_spec\n"
    "spec = load_spec(json.loads(sys.argv[1]))\n"
    "backend = get_backend(spec.placement.backend, spec.placement)\n"
    "needs = registry.kind_of(spec).needs(spec)\n"
    "backend.check(spec, needs)\n"
    "cluster = backend.provision(spec, owner_labels(sys.argv[2], spec.name))\n"
    "unit = WorkUnit(name='main', command=json.loads(sys.argv[3]))\n"
    "backend.run(cluster, unit, {}, 600, lambda stream, line: print(line, flush=True))\n"
)


class Running:
    """The Prefect API's answer for every run: still running (its gpuflow may be dead)."""

    def state(self, run_id: str, api_url: str | None) -> str:
        return "running"

    def states(self, runs):
        return dict.fromkeys(runs, "running")


@dataclass
class Place:
    """One backend as the contract drives it."""

    name: str
    raw: dict[str, Any]  # the spec, less the job
    left: Callable[[str], list[str]]  # what the OS or API still holds of a run
    env: dict[str, str] = field(default_factory=dict)  # for an orchestrator subprocess
    orphan_after_s: float = 0.0  # how long a killed orchestrator's run takes to look orphaned
    # or, where it can be seen: a run's orphaned once this holds (waited on, not slept)
    orphaned: Callable[[str], bool] | None = None
    exits: Callable[[], list[int]] = list  # exit codes the backend's nodes saw, where known

    def spec(self, command: list[str]) -> JobSpec:
        return load_spec({**self.raw, "job": {"kind": "command", "command": command}})

    @property
    def backend(self) -> Backend:
        return get_backend(self.raw["placement"]["backend"], self.spec(["true"]).placement)


def processes_of(marker: str) -> list[str]:
    """Return the live processes on this machine whose command line holds `marker`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"process {proc.info['pid']}")
    return found


def clusters_of(backend_name: str, run_id: str) -> list[str]:
    return [c.name for c in get_backend(backend_name).list_owned({RUN_LABEL: run_id})]


def settle(left: Callable[[], list[str]], seconds: float = 90) -> list[str]:
    """Return what is left once nothing is, or what is still there after `seconds`."""
    until = time.monotonic() + seconds
    while (found := left()) and time.monotonic() < until:
        time.sleep(0.5)
    return found


@pytest.fixture(params=BACKENDS)
def place(request, tmp_path, gpuflow_home, prefect_api) -> Iterator[Place]:
    name = request.param
    base = {"name": "contract", "limits": {"max_duration": "10m", "stop_grace_s": 20}}
    env = subprocess_env(prefect_api, gpuflow_home)
    if name in ("local", "toy"):

        def left(run_id: str) -> list[str]:
            return clusters_of(name, run_id) + processes_of(run_id)

        yield Place(name, {**base, "placement": {"backend": name}}, left, env)
    elif name == "kubernetes":
        from tests.e2e.test_kubernetes import kube_in, owned

        kube = kube_in(request.getfixturevalue("kube"), KUBELET_NS)
        env["KUBECONFIG"] = os.environ["KUBECONFIG"]
        raw = {
            **base,
            "resources": {"gpus": 1, "gpu_product": "H100"},
            "placement": {"backend": "kubernetes", "namespace": KUBELET_NS},
        }
        with PlayedKubelet(kube, tmp_path / "kubelet") as kubelet:

            def left(run_id: str) -> list[str]:
                return owned(kube, run_id) + processes_of(run_id)

            yield Place(name, raw, left, env, exits=lambda: list(kubelet.exits.values()))
    elif name == "fleet":
        from tests.e2e.fleet_bed import records_on

        bed = request.getfixturevalue("contract_fleet")
        raw = {
            **base,
            "resources": {"gpus": 1},
            "placement": {"backend": "fleet", "fleet": "contract"},
        }

        def left(run_id: str) -> list[str]:  # recorded here, on the host, or running
            here = clusters_of(name, run_id)
            there = [f"c1: {r}" for r in records_on(bed, "c1") if run_id in r]
            return here + there + processes_of(run_id)

        def orphaned(run_id: str) -> bool:  # its lease lapsed: the host ended its claim
            return not any(run_id in r for r in records_on(bed, "c1"))

        yield Place(name, raw, left, env, orphaned=orphaned)
    elif name == "slurm":
        env["SLURM_CONF"] = str(request.getfixturevalue("slurm"))
        raw = {
            **base,
            "resources": {"gpus": 1, "gpu_product": "H100"},
            "placement": {"backend": "slurm", "workspace_root": str(tmp_path / "workspaces")},
        }

        def left(run_id: str) -> list[str]:
            return clusters_of(name, run_id) + processes_of(run_id)

        yield Place(name, raw, left, env)
    elif name == "ec2":
        from tests.e2e.conftest import FLEET
        from tests.e2e.test_ec2 import left_of
        from tests.e2e.test_ec2 import spec as ec2_spec

        aws, s3_server = request.getfixturevalue("aws"), request.getfixturevalue("s3_server")
        request.getfixturevalue("played")  # boots the instances gpuflow launches, here
        raw = ec2_spec(["true"], limits={"orphan_after": "12s", "stop_grace_s": 20})
        raw["placement"]["block"] = FLEET
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}

        def left(run_id: str) -> list[str]:
            found = left_of(aws, s3_server, run_id)
            return [f"{kind} {item}" for kind, items in found.items() for item in items] + (
                processes_of(run_id)
            )

        yield Place(name, raw, left, env, orphan_after_s=13.0)
    elif name == "alibaba":
        from tests.e2e.alibaba_bed import ecs_spec, left_on_ecs

        ecs, s3_server = request.getfixturevalue("ecs"), request.getfixturevalue("s3_server")
        request.getfixturevalue("played_ecs")  # boots the instances gpuflow launches, here
        raw = ecs_spec(["true"], limits={"orphan_after": "12s", "stop_grace_s": 20})

        def left(run_id: str) -> list[str]:
            return left_on_ecs(ecs, s3_server, run_id) + processes_of(run_id)

        yield Place(name, raw, left, env, orphan_after_s=13.0)
    elif name == "tencent":
        from tests.e2e.tencent_bed import cvm_spec, left_on_cvm

        cvm, s3_server = request.getfixturevalue("cvm"), request.getfixturevalue("s3_server")
        request.getfixturevalue("played_cvm")  # boots the instances gpuflow launches, here
        raw = cvm_spec(["true"], limits={"orphan_after": "12s", "stop_grace_s": 20})

        def left(run_id: str) -> list[str]:
            return left_on_cvm(cvm, s3_server, run_id) + processes_of(run_id)

        yield Place(name, raw, left, env, orphan_after_s=13.0)
    else:
        pytest.fail(f"the registered backend {name!r} has no test bed here: give it one")


def test_contract_provision_adopts_lines_arrive_in_order_and_teardown_leaves_nothing(place):
    """Provision twice with one run id: the second adopts the first. A unit's lines come
    back in the order it printed them. Teardown twice is harmless; nothing is left."""
    run_id = f"contract-{place.name}-{os.getpid()}"
    command = [sys.executable, "-c", f"[print(i, flush=i % 50 == 0) for i in range({LINES})]"]
    spec = place.spec([*command, run_id])
    backend = place.backend
    backend.check(spec, kind_of(spec).needs(spec))
    first = backend.provision(spec, owner_labels(run_id, spec.name))
    again = backend.provision(spec, owner_labels(run_id, spec.name))
    assert again.adopted and again.name == first.name
    assert [c.name for c in backend.list_owned({RUN_LABEL: run_id})] == [first.name]
    lines: list[str] = []
    try:
        result = backend.run(
            again,
            WorkUnit(name="main", command=[*command, run_id]),
            {},
            300,
            lambda stream, line: lines.append(line) if line.strip().isdigit() else None,
        )
        assert result.exit_code == 0, result.log_tail
        assert lines == [str(i) for i in range(LINES)]
    finally:
        backend.teardown(again)
    backend.teardown(again)  # already gone: no error
    assert settle(lambda: place.left(run_id)) == []


def test_contract_a_staged_working_folder_reaches_the_units_node(place, tmp_path):
    """The backend's `stage` puts a packed working folder where its nodes read it; a unit
    started through gpuflow's starter runs in it there, and teardown leaves nothing."""
    from gpuflow.tasks.storage import S3Settings
    from gpuflow.tasks.workdir import Start, pack

    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "hello.txt").write_text(f"hello from the working folder of {place.name}\n")
    packed = pack(folder, 1 << 20, tmp_path / "packed")
    run_id = f"contract-stage-{place.name}-{os.getpid()}"
    spec = place.spec(["true"])
    backend = place.backend
    cluster = backend.provision(spec, owner_labels(run_id, spec.name))
    lines: list[str] = []
    try:
        where = backend.stage(cluster, Path(packed.path), S3Settings.from_env(), None)
        start = Start(archive=where, sha256=packed.sha256).model_dump_json()
        show = "print(open('hello.txt').read().strip())"
        unit = WorkUnit(
            name="main",
            command=[
                sys.executable,
                "-m",
                "gpuflow.tasks.workdir",
                start,
                "--",
                "python",
                "-c",
                show,
            ],
        )
        result = backend.run(cluster, unit, {}, 300, lambda stream, line: lines.append(line))
        assert result.exit_code == 0, result.log_tail
        assert f"hello from the working folder of {place.name}" in lines
    finally:
        backend.teardown(cluster)
    assert settle(lambda: place.left(run_id)) == []


def test_contract_offers_price_the_job(place):
    """What a backend could give the job now (a pool's candidate row): at least one offer,
    each saying where, at a price of zero or more, and why not when it cannot start now."""
    from gpuflow.tasks.pipeline.checks import check_spec

    spec, prices = check_spec(place.spec(["true"]))
    found = place.backend.offers(spec, prices)
    assert found, "a backend gives at least one offer (one that cannot start says why)"
    for offer in found:
        assert offer.where and offer.hourly_usd >= 0
        assert offer.can_start or offer.why_not
        assert offer.gpus_free is None or offer.gpus_free >= 0


def test_contract_a_stop_request_ends_the_unit_within_its_grace(place):
    """A stop check that says stop: the unit gets SIGTERM and its grace, saves its state
    and exits 75 (not SIGKILL), and the result says it was cancelled. What it wrote in its
    grace is in the workspace's outputs here once run returns (collect keeps it)."""
    run_id = f"contract-stop-{place.name}-{os.getpid()}"
    spec = place.spec(["true"])
    backend = place.backend
    cluster = backend.provision(spec, owner_labels(run_id, spec.name))
    lines: list[str] = []
    try:
        result = backend.run(
            cluster,
            WorkUnit(name="main", command=[sys.executable, "-c", STOPPABLE, run_id]),
            {},
            300,
            lambda stream, line: lines.append(line),
            should_stop=lambda: "ready" in lines,
            grace_s=20,
        )
        assert result.cancelled and not result.timed_out
        if place.name == "kubernetes":  # the pod is deleted with its grace: its kubelet saw
            assert settle(lambda: [] if 75 in place.exits() else ["no exit yet"]) == []
        else:
            assert result.exit_code == 75 and result.signal is None, (result, lines)
            assert "stopped cleanly" in lines
        kept = Path(cluster.workspace) / "outputs" / "checkpoint.txt"
        assert kept.read_text() == "saved on SIGTERM", (place.name, lines)
    finally:
        backend.teardown(cluster)
    assert settle(lambda: place.left(run_id)) == []


def test_contract_the_reaper_finds_what_a_killed_orchestrator_left(place, tmp_path, monkeypatch):
    """An orchestrator provisions, starts a long unit and is killed (SIGKILL): the
    backend's reaper, told the run is still running in the API, finds it orphaned and
    removes everything, the unit included."""
    run_id = f"contract-reap-{place.name}-{os.getpid()}"
    unit = [sys.executable, "-c", "import time; print('working', flush=True); time.sleep(600)"]
    spec = place.spec(unit)
    orchestrator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ORCHESTRATOR,
            spec.model_dump_json(),
            run_id,
            json.dumps([*unit, run_id]),
        ],
        env=place.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said: list[str] = []
    try:
        for line in orchestrator.stdout:  # type: ignore[union-attr]
            said.append(line.rstrip())
            if "working" in line:
                break
        assert "working" in said, "\n".join(said[-20:])
    finally:
        orchestrator.send_signal(signal.SIGKILL)
        orchestrator.wait(timeout=30)
    assert place.left(run_id)  # what it left is there
    if place.orphaned is not None:
        assert settle(lambda: [] if place.orphaned(run_id) else ["not orphaned yet"]) == []
    else:
        time.sleep(place.orphan_after_s)  # EC2: until its heartbeat is older than orphan_after
    lines: list[str] = []
    if place.name in ("alibaba", "tencent"):  # no rate for CNY here: said, not priced at $0
        monkeypatch.delenv("GPUFLOW_USD_PER_CNY", raising=False)
        place.backend.reap(True, lines.append, Running())
        assert "unpriced here: no USD rate for CNY (GPUFLOW_USD_PER_CNY)" in "\n".join(lines)
    monkeypatch.setenv("GPUFLOW_USD_PER_CNY", "0.14")  # the rate `gpuflow reap` prices CNY at
    lines.clear()
    found = place.backend.reap(False, lines.append, Running())
    assert sum(found.counts.get(k, 0) for k in ("clusters", "runs")) >= 1, lines
    if place.name in ("ec2", "alibaba", "tencent"):  # priced, in USD (CNY at the rate set)
        assert found.counts["hourly_usd"] > 0 and "unpriced" not in "\n".join(lines), lines
    assert settle(lambda: place.left(run_id)) == []
    place.backend.reap(False, lines.append, Running())  # again: nothing to do, no error


def test_a_backend_from_the_tests_runs_a_job_through_gpu_pipeline(prefect_api, gpuflow_home):
    """The toy backend, defined outside gpuflow's package, runs a job through the whole
    pipeline with no change to stages, flows or the CLI; teardown leaves nothing."""
    from gpuflow.flows.pipeline import gpu_pipeline

    script = "import os; print('node', os.environ['GPUFLOW_NODE_RANK'], 'of', os.environ['GPUFLOW_NODES'])"
    spec = load_spec(
        {
            "name": "toy-job",
            "job": {"kind": "command", "command": [sys.executable, "-c", script]},
            "placement": {"backend": "toy"},
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.cluster.backend == "toy" and result.exit_code == 0
    from tests.e2e.helpers import logs_of

    assert any("node 0 of 1" in line for line in logs_of(result.flow_run_id))
    assert clusters_of("toy", result.flow_run_id) == []


def test_an_unknown_backend_is_refused_by_name_before_anything_is_made():
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_spec

    spec = load_spec(
        {"job": {"kind": "command", "command": ["true"]}, "placement": {"backend": "nomad"}}
    )
    known = "local, kubernetes, ec2, slurm, fleet, alibaba, tencent, toy"
    with pytest.raises(
        InvalidSpec, match=f"placement.backend: 'nomad' is not a backend; use one of: {known}"
    ):
        check_spec(spec)
