"""An SSH fleet of GPU servers: hosts on this machine, each a network namespace with its
own address, sshd, host key, fake NVML and GPUFLOW_HOME (scripts/fleet-testbed.sh)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_spec
from gpuflow.tasks.spec import load_spec
from tests.e2e.fleet_bed import claims_on, fleet_bed, host_entry, records_on, save_fleet
from tests.e2e.helpers import artifacts_of, command_lines_seen, flow_run, logs_of, process_gone

ROOT = Path(__file__).parents[2]
GPUFLOW = [sys.executable, "-m", "gpuflow"]
HOSTS = ["g1:4", "g2:4", "g3:4", "small:1:NVIDIA L4", "nopy:1::nopython"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """Five hosts: three with 4 H100s, one with an L4, one without Python."""
    with fleet_bed(tmp_path_factory.mktemp("fleet") / "bed", HOSTS) as found:
        yield found


def cli_env(prefect_api: str, gpuflow_home: Path) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)}


def cli(prefect_api, gpuflow_home, *argv: str) -> subprocess.CompletedProcess:
    """Run `gpuflow ARGV` against the test API; return how it ended."""
    return subprocess.run(
        [*GPUFLOW, *argv],
        env=cli_env(prefect_api, gpuflow_home),
        capture_output=True,
        text=True,
        timeout=300,
    )


def apply(prefect_api, gpuflow_home, source: str) -> subprocess.CompletedProcess:
    return cli(prefect_api, gpuflow_home, "fleet", "apply", source)


@pytest.fixture(scope="module")
def lab(bed, prefect_api, tmp_path_factory):
    """Fleet `lab`: g1, g2, g3 (4 GPUs each), applied."""
    save_fleet(bed, "lab", [host_entry(bed, n) for n in ("g1", "g2", "g3")], lease_s=10)
    done = apply(prefect_api, tmp_path_factory.mktemp("home"), "lab")
    assert done.returncode == 0, done.stdout + done.stderr
    return bed


def fleet_spec(command: list[str], gpus: int = 1, nodes: int = 1, **over) -> dict:
    raw = {
        "name": "on-fleet",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": gpus, "nodes": nodes},
        "placement": {"backend": "fleet", "fleet": "lab"},
        "limits": {"max_duration": "10m"},
    }
    return raw | over


def host_state(bed: dict, name: str) -> Path:
    return Path(bed["dir"]) / name / "gpuflow"


def test_apply_checks_every_host_and_names_the_ones_kept_out(bed, prefect_api, gpuflow_home):
    """`fleet apply` from YAML: hosts that pass serve (gpuflow's wheel put there, their GPUs
    recorded); a host without Python, one whose host key changed, and one (reached through
    a jump host) whose NVML sees fewer GPUs than its entry says are each named with their
    reason."""
    from gpuflow.blocks import GpuFleet

    save_fleet(bed, "apply-probe", [])  # the key's Secret block
    # g2's address with g1's key: the key g2 shows is not the one known for it
    forged = (
        host_entry(bed, "g2")["known_hosts"].split()[0]
        + " "
        + " ".join(host_entry(bed, "g1")["known_hosts"].split()[1:])
    )
    spec = {
        "name": "apply-test",
        "ssh_key": "fleet-test-key",
        "hosts": [
            host_entry(bed, "g1"),
            host_entry(bed, "small"),
            host_entry(bed, "nopy"),
            host_entry(bed, "g2", name="g2-forged", known_hosts=forged),
            # reached through g1 (a jump host: its key checked too)
            host_entry(
                bed,
                "g3",
                gpus=8,
                jump=f"root@{host_entry(bed, 'g1')['address']}",
                known_hosts=host_entry(bed, "g3")["known_hosts"]
                + "\n"
                + host_entry(bed, "g1")["known_hosts"],
            ),
        ],
    }
    path = gpuflow_home.parent / "fleet.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec))
    done = apply(prefect_api, gpuflow_home, str(path))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "fleet apply-test: 2 of 5 host(s) serve" in out, out
    assert "g1               serves: 4 x NVIDIA-H100-80GB-HBM3" in out, out
    assert "small            serves: 1 x NVIDIA-L4" in out, out
    assert "nopy             kept out: python: host nopy has no python3 on its PATH" in out, out
    assert "g2-forged        kept out: known_hosts: fleet host g2-forged" in out, out
    assert "shows a host key other than the one known_hosts has for it" in out, out
    assert "g3               kept out: gpus: host g3 should have 8 GPU(s) but NVML sees 4" in out, (
        out
    )
    g3_log = (Path(bed["dir"]) / "g3" / "sshd.log").read_text()
    assert f"Connection from {host_entry(bed, 'g1')['address']}" in g3_log  # came through g1
    saved = GpuFleet.load("apply-test")
    assert [c.host for c in saved.checked if c.ok] == ["g1", "small"]
    lib = host_state(bed, "g1") / "fleet" / "lib"
    assert lib.is_dir()  # gpuflow put there, the user's alone
    assert all(p.stat().st_mode & 0o077 == 0 for p in [lib, *lib.iterdir()])
    assert bed["key"] not in out + done.stderr


def test_a_one_gpu_run_takes_one_gpu_of_a_host_and_gives_it_back(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """The unit runs on a host of the fleet with CUDA_VISIBLE_DEVICES of its claim, in the
    host's namespace; its outputs come back; its secret reaches it, and no log or command
    line; afterwards no claim is left on any host."""
    from prefect.blocks.system import Secret

    Secret(value="tok-fleet-31f7").save("fleet-test-token", overwrite=True)
    show = (
        'echo "netns=$(stat -L -c %i /proc/self/ns/net) gpus=$CUDA_VISIBLE_DEVICES'
        ' tok=$TOKEN"; echo done > "$GPUFLOW_OUTPUT_DIR/result.txt";'
        " cat /proc/self/cgroup; sleep 1"
    )
    raw = fleet_spec(
        ["sh", "-c", show], secret_env={"TOKEN": "fleet-test-token"}, metrics={"interval_s": 0.2}
    )
    spec_file = tmp_path / "one.yaml"
    spec_file.write_text(json.dumps(raw))
    looked = cli(prefect_api, gpuflow_home, "preflight", str(spec_file))  # where it would go
    assert looked.returncode == 0 and "Traceback" not in looked.stderr, looked.stderr
    for host in ("g1", "g2", "g3"):
        assert f"[pass] offer: fleet/lab {host}: GPUs" in looked.stdout, looked.stdout
    with command_lines_seen() as seen:  # here and on the hosts (one machine)
        state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    # the secret went over the SSH connection, never a command line here or on the host
    assert any("gpuflow.tasks.backends.local.remote serve" in line for line in seen)
    assert not any("tok-fleet-31f7" in line for line in seen)
    result = state.result()
    logs = logs_of(state.state_details.flow_run_id)
    text = "\n".join(logs)
    assert "gpus=0 tok=***" in text, text
    assert "tok-fleet-31f7" not in text
    host = result.cluster.node_names[0]
    assert host in ("g1", "g2", "g3")
    # the host sampled its GPUs into the run's metrics, and the run names where it ran
    assert result.metrics.samples > 0 and result.metrics.gpu_seen, result.metrics
    assert any(f"on {result.cluster.hostname}: workspace" in line for line in logs), text
    summary = artifacts_of(state.state_details.flow_run_id)["gpuflow-summary"].data
    assert f"on {result.cluster.hostname};" in summary, summary
    from gpuflow.tasks.platform.runs import listed  # what `gpuflow ls` shows

    [row] = [r for r in listed(50) if r.id == str(state.state_details.flow_run_id)]
    assert (row.backend, row.host) == ("fleet", result.cluster.hostname)
    namespace = next(h["namespace"] for h in lab["hosts"] if h["name"] == host)
    assert f"netns={os.stat(f'/run/netns/{namespace}').st_ino} gpus=0" in text, text
    kept = list((gpuflow_home / "runs").rglob("result.txt"))  # brought back, then collected
    assert [p.read_text() for p in kept] == ["done\n"], kept
    # in a cgroup of the host's local backend (named after the run), not the orchestrator's
    assert any(f"{result.cluster.name}-" in line and "pids:" in line for line in logs), text
    assert not Path(result.cluster.workspace).exists()
    for host in ("g1", "g2", "g3"):
        assert claims_on(lab, host) == []


SWEEP = textwrap.dedent(
    """
    import json, sys
    import gpuflow
    raw = json.loads(sys.argv[1])
    specs = [{**raw, "name": f"sweep-{sys.argv[2]}-{i}"} for i in range(4)]
    states = gpuflow.gpu_jobs(specs, return_state=True)
    sys.exit(0 if all(s.is_completed() for s in states) else 1)
    """
)


@pytest.mark.timeout(420)
def test_twelve_one_gpu_runs_from_three_processes_share_three_hosts_of_four(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """3 processes, 4 runs each, at once, on 3 hosts x 4 GPUs: every run gets a GPU no other
    run holds, and all 12 run at the same time (each waits until the 12 have started)."""
    met = tmp_path / "met"  # the hosts share this machine's files: a place all units see
    met.mkdir()
    wait_all = (
        'host="${GPUFLOW_WORKSPACE#*/bed/}"; mark="${host%%/*}-gpu$CUDA_VISIBLE_DEVICES";'
        f' echo "$mark" > {met}/"$mark"; n=0;'
        f' while [ "$(ls {met} | wc -l)" -lt 12 ]; do n=$((n+1));'
        ' [ $n -gt 3000 ] && { echo "only $(ls ' + str(met) + ' | wc -l) of 12 met"; exit 1; };'
        " sleep 0.1; done; echo met"
    )
    raw = fleet_spec(["sh", "-c", wait_all])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SWEEP, json.dumps(raw), str(i)],
            env=cli_env(prefect_api, gpuflow_home / f"p{i}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(3)
    ]
    said = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(s[-3000:] for s in said)
    marks = sorted(p.name for p in met.iterdir())
    assert len(marks) == 12 and len(set(marks)) == 12, marks  # no GPU given twice
    assert {m.split("-gpu")[0] for m in marks} == {"g1", "g2", "g3"}
    assert all(m.split("-gpu")[1] in "0123" for m in marks), marks
    for host in ("g1", "g2", "g3"):
        assert claims_on(lab, host) == [] and records_on(lab, host) == []


def test_bad_fleet_input_is_one_sentence_before_anything_is_claimed(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """A fleet name no block has; more GPUs per node than the largest host has (the sentence
    names it); more nodes than hosts; a host listed twice; a key with a passphrase."""
    for raw, said in [
        (
            fleet_spec(["true"]) | {"placement": {"backend": "fleet", "fleet": "no-such"}},
            "placement.fleet: there is no GpuFleet block named 'no-such'; create it with"
            " `gpuflow fleet apply FLEET.yaml`",
        ),
        (
            fleet_spec(["true"], gpus=8),
            "resources.gpus: 8 GPU(s) per node is more than any host of fleet 'lab' has (the"
            " largest, g1, has 4); ask for at most 4 per node, or use more nodes.",
        ),
        (
            fleet_spec(["true"], gpus=2, nodes=4),
            "resources.nodes: 4 nodes with 2 GPU(s) each, but fleet 'lab' has 3 host(s) with"
            " that many; ask for at most 3 nodes.",
        ),
    ]:
        with pytest.raises(InvalidSpec) as refused:
            check_spec(load_spec(raw))
        assert said in str(refused.value), str(refused.value)
        assert "\n" not in str(refused.value)
    twice = gpuflow_home.parent / "twice.yaml"
    entry = host_entry(lab, "g1")
    twice.write_text(json.dumps({"name": "twice", "hosts": [entry, entry | {"name": "again"}]}))
    done = apply(prefect_api, gpuflow_home, str(twice))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "gpuflow: invalid input: hosts[1] (again) is listed twice (hosts[0]); remove one of them."
    ), done.stderr
    locked = tmp_path / "locked"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-words", "-f", str(locked)], check=True
    )
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet

    Secret(value=locked.read_text()).save("fleet-locked-key", overwrite=True)
    GpuFleet(hosts=[host_entry(lab, "g1")], ssh_key="fleet-locked-key").save(
        "locked", overwrite=True
    )
    done = apply(prefect_api, gpuflow_home, "locked")
    assert done.returncode == 1
    assert (
        "kept out: ssh_key: the key in Secret block 'fleet-locked-key' (host g1) is protected"
        " by a passphrase" in done.stdout
    ), done.stdout
    assert claims_on(lab, "g1") == []


def units_under(bed: dict) -> list[psutil.Process]:
    """The processes of units running on the test bed's hosts (their workspace is there)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if str(bed["dir"]) in proc.environ().get("GPUFLOW_WORKSPACE", ""):
                found.append(proc)
    return found


def in_thread(body) -> threading.Thread:
    """Start `body` in a thread with this one's context (the test's Prefect API with it)."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(body,))
    thread.start()
    return thread


def wait_for(condition, seconds: float, what: str):
    until = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < until, f"{what} did not happen within {seconds:.0f} s"
        time.sleep(0.2)
    return found


@pytest.mark.timeout(300)
def test_a_killed_orchestrators_gpus_come_free_after_its_lease_and_its_unit_stops(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """`gpuflow run` SIGKILLed while its unit runs on a host: nothing of it is left to stop
    the unit, yet once its lease lapses (10 s here) the host stops the unit (SIGTERM first:
    it says so) and frees its GPU; `fleet status` then shows every GPU free. What the job
    wrote (a checkpoint before, one more file on SIGTERM) is set aside on the host and
    brought back by `gpuflow reap` into the run's artifacts, then let go on the host."""
    import yaml

    path = tmp_path / "long.yaml"
    command = (
        'cd "$GPUFLOW_OUTPUT_DIR"; for i in $(seq 40); do echo $i > ckpt-$i; done;'
        " trap 'echo stopped > last; exit 75' TERM; echo started; sleep 600 & wait"
    )
    path.write_text(yaml.safe_dump(fleet_spec(["sh", "-c", command])))
    orchestrator = subprocess.Popen(
        [*GPUFLOW, "run", str(path)],
        env=cli_env(prefect_api, gpuflow_home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        unit = wait_for(lambda: units_under(lab), 120, "the unit's start")
        held = [h for h in ("g1", "g2", "g3") if claims_on(lab, h)]
        assert len(held) == 1, held
        keys = Path(tempfile.gettempdir()).glob(f"gpuflow-ssh-{orchestrator.pid}-*")
        assert list(keys), "the run's SSH key folder is named by its process"
        orchestrator.send_signal(signal.SIGKILL)
        orchestrator.wait()
        wait_for(lambda: not units_under(lab), 90, "the unit's stop")
        wait_for(lambda: not claims_on(lab, held[0]), 30, "the GPU's release")
        aside = host_state(lab, held[0]) / "fleet" / "kept"
        assert [len(list(p.iterdir())) for p in aside.iterdir()] == [41], "set aside on the host"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orchestrator.pid, signal.SIGKILL)
    assert all(process_gone(p.pid) for p in unit)
    # what the killed gpuflow recorded here: `gpuflow reap` forgets it (no host holds it)
    # and marks its flow run Crashed
    [record] = (gpuflow_home / "fleet" / "clusters").glob("*.json")
    reaped = cli(prefect_api, gpuflow_home, "reap", "--backend", "fleet", "--block", "lab")
    assert reaped.returncode == 0, reaped.stdout + reaped.stderr
    assert f"forgetting {record.stem}: no host holds it" in reaped.stdout, reaped.stdout
    assert "1 flow run(s) marked Crashed" in reaped.stdout, reaped.stdout
    assert "the job's outputs were kept: 41 file(s) in" in reaped.stdout, reaped.stdout
    (kept,) = (gpuflow_home / "runs").glob("on-fleet-*/outputs")
    assert (kept / "ckpt-40").read_text() == "40\n" and (kept / "last").read_text() == "stopped\n"
    assert not list(aside.iterdir()), "the host's copy is let go once brought back"
    assert not record.exists()
    # the fleet's private SSH key, in a folder named by the killed process: removed by a
    # reap (this one, or one another command ran meanwhile: any reap removes a dead one's)
    assert not list(Path(tempfile.gettempdir()).glob(f"gpuflow-ssh-{orchestrator.pid}-*"))
    assert flow_run(record.stem.removeprefix("gpuflow-")).state.is_crashed()
    status = cli(prefect_api, gpuflow_home, "fleet", "status", "lab", "--json")
    rows = json.loads(status.stdout)["hosts"]
    offers = cli(prefect_api, gpuflow_home, "offers", str(path), "--json")
    shown = {(o["where"], o["gpus_free"], o["can_start"]) for o in json.loads(offers.stdout)}
    assert shown == {(f"fleet/lab {h}", 4, True) for h in ("g1", "g2", "g3")}, offers.stdout
    assert [(r["host"], r["free"], r["runs"]) for r in rows] == [
        ("g1", 4, []),
        ("g2", 4, []),
        ("g3", 4, []),
    ], rows


@pytest.fixture(scope="module")
def bed_s3(lab, tmp_path_factory):
    """moto on the test bed's bridge: storage this machine and every host reach."""
    from tests.conftest import save_aws_block, serve_s3

    with serve_s3(lab["address"], tmp_path_factory.mktemp("bed-moto")) as server:
        save_aws_block(server, "fleet-test-aws")
        yield server


def fleet_training(bed_s3, name: str, **over) -> dict:
    from gpuflow.flows.datasets import prepare_dataset
    from tests.e2e.test_training import train_spec

    dataset = bed_s3.url("datasets/fleet")
    prepare_dataset("synthetic:classify?samples=128", dataset, "40KB", "fleet-test-aws")
    raw = train_spec(dataset, bed_s3.url(f"runs/fleet-{name}"), max_steps=20, cpu_processes=1)
    raw["storage"] = {"aws_credentials": "fleet-test-aws"}
    raw["placement"] = {"backend": "fleet", "fleet": "lab"}
    raw["limits"] = {"max_duration": "10m", "stop_grace_s": 5}
    raw["resources"] = {"gpus": 1}
    return raw | over


@pytest.mark.timeout(300)
def test_training_on_two_nodes_spans_two_hosts_whose_ranks_meet(lab, bed_s3, prefect_api):
    """resources.nodes: 2 takes one GPU on each of two hosts; torchrun on each meets at the
    first host's address (a port of the run's own) and the two ranks train as one job."""
    from gpuflow.flows.train import train

    raw = fleet_training(bed_s3, "two", resources={"gpus": 1, "nodes": 2})
    state = train(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.metrics.job["world_size"] == 2 and result.metrics.job["steps"] == 20
    names = result.cluster.node_names
    assert len(set(names)) == 2 and set(names) <= {"g1", "g2", "g3"}
    assert result.cluster.rendezvous.startswith(result.cluster.node_addresses[0] + ":")
    for host in ("g1", "g2", "g3"):
        assert claims_on(lab, host) == []


@pytest.mark.timeout(420)
def test_a_host_cut_off_mid_run_is_a_preemption_and_the_training_resumes_on_another(
    lab, bed_s3, prefect_api, gpuflow_home
):
    """The host's link goes down while its rank is held at step 6 (checkpoint 5 saved):
    the orchestrator hears nothing for a lease and calls the host lost; the host, hearing
    no renewal, stops the unit and frees its GPU; once that has surely happened the run
    resumes from the checkpoint on another host. The host, back, serves again."""

    from gpuflow.flows.train import train
    from tests.e2e.helpers import hold_ranks_at, release_when_signalled

    raw = fleet_training(bed_s3, "cut")
    done: dict = {}
    flow = in_thread(lambda: done.update(state=train(load_spec(raw), return_state=True)))
    held, stopped_at = hold_ranks_at(Path(lab["dir"]), 6, ranks=1, seconds=180)
    host = Path(held[0].cwd()).relative_to(lab["dir"]).parts[0]
    veth = next(h["veth"] for h in lab["hosts"] if h["name"] == host)
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        release_when_signalled(held, seconds=120)  # the host's own lease lapse sends it
        wait_for(lambda: not claims_on(lab, host), 60, f"{host}'s release of the GPU")
        flow.join(timeout=300)
        assert not flow.is_alive(), "the run did not end"
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    state = done["state"]
    assert state.is_completed(), state.message
    assert stopped_at < 20
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "resumed from checkpoint step 5" in logs, logs
    assert f"fleet host {host}" in logs and "has not answered" in logs, logs
    assert state.result().metrics.job["steps"] == 20
    for name in ("g1", "g2", "g3"):
        assert claims_on(lab, name) == []
    # back: it serves again (a one-GPU run on each host at once reaches it)
    status = cli(prefect_api, gpuflow_home, "fleet", "status", "lab", "--json")
    rows = {r["host"]: r for r in json.loads(status.stdout)["hosts"]}
    assert rows[host]["free"] == 4, rows[host]


@pytest.mark.timeout(300)
def test_copies_per_gpu_get_the_gpus_their_host_claimed_not_the_first_ones(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """On a one-host fleet whose GPU 0 another run holds, a two-GPU run with a copy per GPU
    gets GPUs 1 and 2 of the host: each copy sees one of them, never the held one."""

    save_fleet(lab, "solo", [host_entry(lab, "g3")], lease_s=10)
    assert apply(prefect_api, gpuflow_home, "solo").returncode == 0
    release = tmp_path / "release"
    hold = fleet_spec(
        ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.1; done"],
        placement={"backend": "fleet", "fleet": "solo"},
    )
    holder = in_thread(lambda: gpu_pipeline(load_spec(hold)))
    try:
        wait_for(lambda: claims_on(lab, "g3") == ["0.json"], 120, "the first run's claim")
        show = {"kind": "command", "command": ["sh", "-c", "echo gpu=$CUDA_VISIBLE_DEVICES"]}
        raw = fleet_spec(
            ["true"],
            gpus=2,
            placement={"backend": "fleet", "fleet": "solo"},
            job=show | {"copies": "per_gpu"},
        )
        state = gpu_pipeline(load_spec(raw), return_state=True)
    finally:
        release.touch()
        holder.join(timeout=120)
    assert state.is_completed(), state.message
    text = "\n".join(logs_of(state.state_details.flow_run_id))
    assert sorted(re.findall(r"gpu=\S*", text)) == ["gpu=1", "gpu=2"], text
    assert claims_on(lab, "g3") == []


def test_idle_gpus_on_a_fleet_host_stop_the_job(lab, prefect_api, gpuflow_home):
    """The host samples its GPUs as the unit runs (its fake NVML says 3 % busy) and the
    samples stream back into the run's workspace as they come: limits.idle_gpu stops the
    unit past `for`, and the run ends saying why, with its GPU free again."""
    raw = fleet_spec(["sleep", "600"])
    raw["limits"]["idle_gpu"] = {"below_pct": 5, "for": "2s", "action": "stop"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_failed()
    assert "the job was stopped because its GPUs" in state.message, state.message
    assert "were under 5% busy" in state.message, state.message
    for host in ("g1", "g2", "g3"):
        assert claims_on(lab, host) == []


@pytest.mark.timeout(300)
def test_a_full_fleet_in_a_pool_is_given_up_for_the_next_candidate(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """A pool of two fleets: the first (one host) has every GPU held by another run, so
    after its gpu_wait the run is placed on the second, which the placement table says.
    The full fleet cannot be deleted while that run holds it; then it can."""
    save_fleet(lab, "solo", [host_entry(lab, "g3")], lease_s=10)
    assert apply(prefect_api, gpuflow_home, "solo").returncode == 0
    release = tmp_path / "release"
    hold = fleet_spec(
        ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.1; done"],
        gpus=4,
        placement={"backend": "fleet", "fleet": "solo"},
    )
    holder = in_thread(lambda: gpu_pipeline(load_spec(hold)))
    try:
        wait_for(lambda: len(claims_on(lab, "g3")) == 4, 120, "the first run's claim")
        raw = fleet_spec(
            ["true"],
            placement=[
                {"backend": "fleet", "fleet": "solo", "gpu_wait": "1s"},
                {"backend": "fleet", "fleet": "lab"},
            ],
        )
        state = gpu_pipeline(load_spec(raw), return_state=True)
        refused = cli(prefect_api, gpuflow_home, "fleet", "delete", "solo")
    finally:
        release.touch()
        holder.join(timeout=120)
    # `fleet delete` is refused while a run holds the fleet's GPUs, and done once none does
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "fleet 'solo' still has runs holding its GPUs (g3: gpuflow-" in refused.stderr
    deleted = cli(prefect_api, gpuflow_home, "fleet", "delete", "solo")
    assert deleted.returncode == 0 and "fleet solo deleted" in deleted.stdout, deleted.stderr
    gone = cli(prefect_api, gpuflow_home, "fleet", "status", "solo")
    assert gone.returncode == 2 and "no GpuFleet block named 'solo'" in gone.stderr
    assert state.is_completed(), state.message
    assert state.result().cluster.node_names[0] in ("g1", "g2")
    text = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "fleet/solo" in text and "fleet/lab" in text, text
    for host in ("g1", "g2", "g3"):
        assert claims_on(lab, host) == []
