"""One pool over every backend: a job placed on a list of candidates runs on the first
the policy picks that can give it its GPUs, fails over when one cannot, and resumes
elsewhere after a preemption; the placement table, its log line and its events say why.
These run on this machine and the test backend; the Kubernetes, Slurm and EC2 pools are
in test_pool_clusters.py."""

from __future__ import annotations

import json
import sys

import pytest

import tests.e2e.toy_backend  # noqa: F401 - registers the toy backend
from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.backends.local.backend import LocalBackend
from gpuflow.tasks.contract import RUN_LABEL, owner_labels
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_pool
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import NOTHING_LEFT, events_named, leftovers, logs_of
from tests.e2e.test_pool_clusters import latest

pytestmark = pytest.mark.e2e

HELLO = [sys.executable, "-c", "print('hello from the pool')"]


def pooled(*placements: dict, command: list[str] = HELLO, **sections) -> dict:
    return {
        "name": "pooled",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1, "allow_cpu": True},
        "placement": list(placements),
        **sections,
    }


@pytest.fixture
def gpu_taken(fake_nvml, gpuflow_home):
    """This host's one GPU, held by another gpuflow run."""
    fake_nvml.config["gpus"] = 1
    other = load_spec(pooled({"backend": "local"}))
    backend = LocalBackend()
    cluster = backend.provision(
        other.model_copy(update={"candidates": ()}), owner_labels("other-run", "other")
    )
    yield cluster
    backend.teardown(cluster)


def test_pool_a_full_candidate_is_given_up_for_the_next(prefect_api, gpuflow_home, gpu_taken):
    """The first candidate (this machine, its GPU held by another run) is given up and
    the job runs on the next; the table, the log line and the events say so, and the
    given-up candidate keeps nothing of this run."""
    state = gpu_pipeline(
        load_spec(pooled({"backend": "local"}, {"backend": "toy"})), return_state=True
    )
    assert state.is_completed(), state.message
    result = state.result()
    run_id = result.flow_run_id
    assert result.cluster.backend == "toy"
    logs = logs_of(run_id)
    assert any(line.startswith("failover: local gave up (only 0 of the 1 GPU(s)") for line in logs)
    assert any(line.startswith("placed on toy") for line in logs), logs
    assert any("hello from the pool" in line for line in logs)
    rows = latest(run_id, "gpuflow-placement").data
    table = {row["candidate"]: row for row in _rows(rows)}
    assert table["[0] local"]["verdict"] == "given up"
    assert table["[0] local"]["can_start_now"] == "no"
    assert "0 of its 1 GPU(s) are free now" in table["[0] local"]["why_not"]
    assert table["[1] toy"]["verdict"] == "chosen"
    [failover] = events_named("gpuflow.placement.failover", f"gpuflow.run.{run_id}")
    assert failover["payload"]["given_up"] == "local" and failover["payload"]["next"] == "toy"
    assert failover["payload"]["candidates"] == ["local", "toy"]
    [chosen] = events_named("gpuflow.placement.chosen", f"gpuflow.run.{run_id}")
    assert chosen["payload"]["chosen"] == "toy"
    # only the other run's cluster and claim remain on this machine
    assert leftovers(gpuflow_home)["records"] == [f"{gpu_taken.name}.json"]
    assert LocalBackend().list_owned({RUN_LABEL: run_id}) == []
    split = result.metrics.by_placement
    assert [(r["candidate"], r["ended"]) for r in split] == [("toy", "completed")]


def test_pool_every_candidate_full_is_one_sentence_and_leaves_nothing(
    prefect_api, gpuflow_home, gpu_taken, tmp_path
):
    """Both candidates (this machine twice, two workspace roots) have no free GPU: the
    run fails with the retryable capacity error, one sentence names each one's reason,
    and nothing of the run is left."""
    raw = pooled(
        {"backend": "local"},
        {"backend": "local", "workspace_root": str(tmp_path / "other-root")},
        retry={"provision": {"retries": 0}},
    )
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_failed()
    message = state.message
    assert (
        "no candidate of the placement list could give the GPUs (local: only 0 of the 1" in message
    )
    assert message.count("only 0 of the 1 GPU(s) asked for are free on this host") == 2
    from gpuflow.tasks.errors import CapacityError

    with pytest.raises(CapacityError):
        state.result()
    run_id = str(state.state_details.flow_run_id)
    rows = _rows(latest(run_id, "gpuflow-placement").data)
    assert [r["verdict"] for r in rows] == ["given up", "given up"]
    assert LocalBackend().list_owned({RUN_LABEL: run_id}) == []
    assert leftovers(gpuflow_home)["workspaces"] == [gpu_taken.name]


def test_pool_cheapest_and_soonest_choose_from_the_offers(prefect_api, gpuflow_home, fake_nvml):
    """This machine priced at $5/h by its block, the toy backend free: cheapest picks
    the toy; soonest picks this machine (listed first, and it can start now)."""
    from gpuflow.blocks.local_host import LocalGpuHost

    LocalGpuHost(gpu_hourly_usd=5.0).save("priced-host", overwrite=True)
    local = {"backend": "local", "block": "priced-host"}
    for choose, expected in (("cheapest", "toy"), ("soonest", "local")):
        raw = pooled(local, {"backend": "toy"}, placement_policy={"choose": choose})
        state = gpu_pipeline(load_spec(raw), return_state=True)
        assert state.is_completed(), state.message
        result = state.result()
        assert result.cluster.backend == expected, choose
        rows = {
            r["candidate"]: r for r in _rows(latest(result.flow_run_id, "gpuflow-placement").data)
        }
        assert rows["[0] local/priced-host"]["usd_per_hour"] == 5.0
        assert rows["[1] toy"]["usd_per_hour"] == 0.0
        assert {r["policy"] for r in rows.values()} == {choose}
        chosen = [name for name, r in rows.items() if r["verdict"] == "chosen"]
        assert chosen == [
            f"[{0 if expected == 'local' else 1}] {'local/priced-host' if expected == 'local' else 'toy'}"
        ]


def test_pool_bad_candidates_are_refused_before_anything_is_made(
    prefect_api, gpuflow_home, tmp_path
):
    """A candidate naming a block that does not exist, one that cannot run the job
    (nodes > 1 on this machine): one sentence naming the candidate; nothing made."""
    missing = load_spec(pooled({"backend": "toy"}, {"backend": "local", "block": "no-such-host"}))
    with pytest.raises(InvalidSpec) as refused:
        check_pool(missing)
    assert str(refused.value).startswith(
        "placement[1].block: there is no LocalGpuHost block named 'no-such-host'"
    )
    two_nodes = load_spec(
        {**pooled({"backend": "toy"}, {"backend": "local"}), "resources": {"nodes": 2}}
    )
    with pytest.raises(
        InvalidSpec, match=r"^placement\[1\] \(local\): resources.nodes: the local backend"
    ):
        check_pool(two_nodes)
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def _rows(data) -> list[dict]:
    import json

    return json.loads(data) if isinstance(data, str) else data


def test_pool_offers_prints_every_candidate_side_by_side(prefect_api, gpuflow_home, tmp_path):
    """`gpuflow offers` on a placement list: one row per candidate in the policy's order
    (GPUs free now, $/h, the job's cost, can it start now, why not), the same as JSON; a
    candidate whose block does not exist is one sentence; nothing is made."""
    import json as jsonlib
    import subprocess

    import yaml

    from gpuflow.blocks.local_host import LocalGpuHost
    from tests.conftest import subprocess_env

    LocalGpuHost(gpu_hourly_usd=2.5).save("offers-host", overwrite=True)
    raw = pooled(
        {"backend": "local", "block": "offers-host"},
        {"backend": "local", "workspace_root": str(tmp_path / "free-root")},
        placement_policy={"choose": "cheapest"},
        limits={"max_duration": "2h"},
    )
    raw["resources"] = {"gpus": 1}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = subprocess_env(prefect_api, gpuflow_home, fake_gpus=2)

    def offers(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "gpuflow", "offers", str(path), *args],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    table = offers()
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == (
        "2 candidate(s) for 1 node(s) x 1 GPU(s), tried cheapest; job cost for"
        " limits.max_duration (2 h):"
    )
    # cheapest first: the free root, then the $2.50/h host ($5.00 for 2 h)
    assert lines[2].split()[:2] == ["1", "local"]
    assert lines[3].split()[:2] == ["0", "local/offers-host"]
    assert "2 x NVIDIA-H100-80GB-HBM3" in lines[3] and "2.500" in lines[3] and "5.00" in lines[3]
    rows = jsonlib.loads(offers("--json").stdout)
    assert [(r["index"], r["hourly_usd"], r["job_usd"], r["can_start"]) for r in rows] == [
        (1, 0.0, 0.0, True),
        (0, 2.5, 5.0, True),
    ]
    assert rows[0]["gpus_free"] == 2 and rows[0]["gpu_product"] == "NVIDIA-H100-80GB-HBM3"
    raw["placement"][0]["block"] = "no-such-host"
    path.write_text(yaml.safe_dump(raw))
    refused = offers()
    assert refused.returncode == 2
    # after the line that names the Prefect API in use: one sentence
    assert refused.stderr.strip().splitlines()[-1] == (
        "gpuflow: invalid input: placement[0].block: there is no LocalGpuHost block named"
        " 'no-such-host'; create it with LocalGpuHost(...).save('no-such-host') or remove"
        " placement[0].block."
    )
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_pool_a_candidate_whose_cloud_does_not_answer_is_passed_over(
    aws, prefect_api, gpuflow_home, tmp_path, capsys
):
    """A candidate whose EC2 endpoint is down is a candidate that cannot start, with the
    real cause, not a refusal of the job: the job runs on the next one. With no other
    candidate, the run says the same cause and is not called invalid input."""
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet
    from gpuflow.tasks.errors import Unreachable
    from tests.conftest import free_port
    from tests.e2e.conftest import FLEET

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    AwsCredentials(
        aws_access_key_id="x",
        aws_secret_access_key="y",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(
            endpoint_url=dead, config={"retries": {"max_attempts": 1, "mode": "standard"}}
        ),
    ).save("gpuflow-down-aws", overwrite=True)
    fleet = Ec2GpuFleet.load(FLEET)
    fleet.aws_credentials = "gpuflow-down-aws"
    fleet.save("gpuflow-down-fleet", overwrite=True)
    down = {"backend": "ec2", "block": "gpuflow-down-fleet"}
    raw = pooled(down, {"backend": "local"})
    assert len(check_pool(load_spec(raw))) == 2
    # `gpuflow offers` shows both: the down one as a candidate that cannot start, and why
    from gpuflow.commands.offers import offers

    job = tmp_path / "pool.json"  # JSON is YAML
    job.write_text(json.dumps(raw))
    capsys.readouterr()
    assert offers(str(job), as_json=True) == 0
    shown = {row["index"]: row for row in json.loads(capsys.readouterr().out)}
    assert shown[0]["error"].startswith("EC2 in us-east-1 did not answer") and dead in str(shown[0])
    assert shown[1]["candidate"] == "local" and shown[1]["can_start"] is True
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    rows = {
        r["candidate"]: r
        for r in _rows(latest(state.result().flow_run_id, "gpuflow-placement").data)
    }
    ec2_row = next(r for name, r in rows.items() if name.startswith("[0] ec2"))
    assert "did not answer" in json.dumps(ec2_row) and dead in json.dumps(ec2_row)
    with pytest.raises(Unreachable, match=r"^EC2 in us-east-1 did not answer when asked to"):
        check_pool(load_spec({**raw, "placement": down}))
    # the block's botocore config is the user's (it made the dead endpoint fail fast
    # above); one botocore does not know is named, before anything is asked
    from gpuflow.tasks.errors import InvalidSpec

    AwsCredentials(
        aws_access_key_id="x",
        aws_secret_access_key="y",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=dead, config={"retrys": 1}),
    ).save("gpuflow-down-aws", overwrite=True)
    with pytest.raises(InvalidSpec) as caught:
        check_pool(load_spec({**raw, "placement": down}))
    assert str(caught.value).startswith(
        "the AwsCredentials block 'gpuflow-down-aws': aws_client_parameters.config is not"
        " botocore's Config (Got unexpected keyword argument 'retrys')"
    ), str(caught.value)
