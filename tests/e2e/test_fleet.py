"""An SSH fleet of GPU servers: hosts on this machine, each a network namespace with its
own address, sshd, host key, fake NVML and GPUFLOW_HOME (scripts/fleet-testbed.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_spec
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import logs_of

ROOT = Path(__file__).parents[2]
TESTBED = ROOT / "scripts" / "fleet-testbed.sh"
GPUFLOW = [sys.executable, "-m", "gpuflow"]
HOSTS = ["g1:4", "g2:4", "g3:4", "small:1:NVIDIA L4", "nopy:1::nopython"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """Five hosts: three with 4 H100s, one with an L4, one without Python."""
    folder = tmp_path_factory.mktemp("fleet") / "bed"
    env = {**os.environ, "FLEET_PYTHON": sys.executable}
    subprocess.run([str(TESTBED), "up", str(folder), *HOSTS], check=True, env=env)
    try:
        yield json.loads((folder / "hosts.json").read_text()) | {
            "key": (folder / "client_key").read_text(),
            "dir": folder,
        }
    finally:
        subprocess.run([str(TESTBED), "down", str(folder)], check=True)


def host_entry(bed: dict, host: str, **over) -> dict:
    found = next(h for h in bed["hosts"] if h["name"] == host)
    entry = {
        "name": host,
        "address": found["address"],
        "known_hosts": found["known_hosts"],
        "gpus": found["gpus"],
    }
    return entry | over


def save_fleet(bed: dict, name: str, hosts: list[dict], **over) -> None:
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet

    Secret(value=bed["key"]).save("fleet-test-key", overwrite=True)
    GpuFleet(hosts=hosts, ssh_key="fleet-test-key", **over).save(name, overwrite=True)


def cli_env(prefect_api: str, gpuflow_home: Path) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)}


def apply(prefect_api, gpuflow_home, source: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GPUFLOW, "fleet", "apply", source],
        env=cli_env(prefect_api, gpuflow_home),
        capture_output=True,
        text=True,
        timeout=300,
    )


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


def claims_on(bed: dict, name: str) -> list[str]:
    folder = host_state(bed, name) / "local" / "gpus"
    return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []


def test_apply_checks_every_host_and_names_the_ones_kept_out(bed, prefect_api, gpuflow_home):
    """`fleet apply` from YAML: hosts that pass serve (gpuflow's wheel put there, their GPUs
    recorded); a host without Python, one whose key the fleet does not know, and one whose
    NVML sees fewer GPUs than its entry says are each named with their reason."""
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
            host_entry(bed, "g3", gpus=8),
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
    saved = GpuFleet.load("apply-test")
    assert [c.host for c in saved.checked if c.ok] == ["g1", "small"]
    assert (host_state(bed, "g1") / "fleet" / "lib").is_dir()  # gpuflow put there
    assert bed["key"] not in out + done.stderr


def test_a_one_gpu_run_takes_one_gpu_of_a_host_and_gives_it_back(
    lab, prefect_api, gpuflow_home, tmp_path
):
    """The unit runs on a host of the fleet with CUDA_VISIBLE_DEVICES of its claim, in the
    host's namespace; its outputs come back; its secret reaches it and no log; afterwards
    no claim is left on any host."""
    from prefect.blocks.system import Secret

    Secret(value="tok-fleet-31f7").save("fleet-test-token", overwrite=True)
    show = (
        'echo "netns=$(stat -L -c %i /proc/self/ns/net) gpus=$CUDA_VISIBLE_DEVICES'
        ' tok=$TOKEN"; echo done > "$GPUFLOW_OUTPUT_DIR/result.txt";'
        " cat /proc/self/cgroup"
    )
    raw = fleet_spec(["sh", "-c", show], secret_env={"TOKEN": "fleet-test-token"})
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    logs = logs_of(state.state_details.flow_run_id)
    text = "\n".join(logs)
    assert "gpus=0 tok=***" in text, text
    assert "tok-fleet-31f7" not in text
    host = result.cluster.node_names[0]
    assert host in ("g1", "g2", "g3")
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
        ' [ $n -gt 1200 ] && { echo "only $(ls ' + str(met) + ' | wc -l) of 12 met"; exit 1; };'
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
        assert claims_on(lab, host) == []


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
