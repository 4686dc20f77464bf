"""A run's EC2 instances against moto's EC2 (server mode on loopback, credentials checked):
launched with IMDSv2 required, an encrypted gp3 root, no key pair, terminate on shutdown and
the owner tags; adopted by a retried launch; two nodes in one placement group; a capacity
error (injected at botocore's boundary, as EC2 sends it) moves to the next offer; removal
leaves nothing, as EC2 describes it."""

from __future__ import annotations

import pytest

from gpuflow.tasks.backends.ec2.catalog import Fleet, Offer, ec2_client
from gpuflow.tasks.backends.ec2.launch import launch, owned_instances, remove
from gpuflow.tasks.contract import owner_labels
from gpuflow.tasks.errors import CapacityError

pytestmark = pytest.mark.e2e
USER_DATA = "#!/bin/sh\necho gpuflow agent\n"


@pytest.fixture
def ec2(s3_server, monkeypatch):
    for key, value in s3_server.settings().child_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return ec2_client(Fleet(region="us-east-1"))


def offer(instance_type: str, zone: str = "us-east-1a", market: str = "on-demand") -> Offer:
    return Offer(
        instance_type=instance_type,
        zone=zone,
        market=market,
        product="NVIDIA-L4",
        gpus=1,
        vcpus=4,
        memory_mib=16384,
        hourly_usd=0.8,
        job_usd=1.6,
    )


def image(ec2) -> str:
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def test_one_instance_is_launched_locked_down_adopted_on_retry_and_removed(ec2):
    owner = owner_labels("run-ec2-one", "ec2-test")
    said: list[str] = []
    first = launch(
        ec2, [offer("g6.xlarge", market="spot")], 1, 100, image(ec2), USER_DATA, owner, said.append
    )
    again = launch(
        ec2, [offer("g6.xlarge", market="spot")], 1, 100, image(ec2), USER_DATA, owner, said.append
    )
    assert again.adopted and again.instance_ids == first.instance_ids  # never doubled
    [instance] = owned_instances(ec2, "run-ec2-one")
    assert instance["InstanceType"] == "g6.xlarge"
    assert instance["Placement"]["AvailabilityZone"] == "us-east-1a"
    assert instance.get("InstanceLifecycle") == "spot"
    assert instance["MetadataOptions"]["HttpTokens"] == "required"
    assert "KeyName" not in instance  # no SSH key: the agent pulls its work
    assert {t["Key"]: t["Value"] for t in instance["Tags"]} == owner
    shutdown = ec2.describe_instance_attribute(
        InstanceId=instance["InstanceId"], Attribute="instanceInitiatedShutdownBehavior"
    )
    assert shutdown["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    volume_id = instance["BlockDeviceMappings"][0]["Ebs"]["VolumeId"]
    [volume] = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"]
    assert (volume["Size"], volume["VolumeType"], volume["Encrypted"]) == (100, "gp3", True)
    assert said == [f"launched 1 x g6.xlarge (spot) in us-east-1a: {instance['InstanceId']}"]
    assert remove(ec2, "run-ec2-one", said.append) == [instance["InstanceId"]]
    assert owned_instances(ec2, "run-ec2-one", ["pending", "running", "shutting-down"]) == []
    assert len(said) == 1  # no group was made, none is deleted
    assert remove(ec2, "run-ec2-one", said.append) == []  # idempotent


def test_two_nodes_are_launched_together_and_removed_together(ec2):
    """moto implements no placement groups (create, describe, delete): the group that could
    not be made is said and the nodes launch without it, as they would where AWS refuses."""
    owner = owner_labels("run-ec2-two", "ec2-test")
    said: list[str] = []
    made = launch(ec2, [offer("g6.12xlarge")], 2, 50, image(ec2), USER_DATA, owner, said.append)
    assert len(made.instance_ids) == 2
    instances = owned_instances(ec2, "run-ec2-two")
    assert {i["InstanceType"] for i in instances} == {"g6.12xlarge"}
    assert {i["Placement"]["AvailabilityZone"] for i in instances} == {"us-east-1a"}
    assert said[0].startswith("no cluster placement group (")
    assert made.placement_group is None
    assert sorted(remove(ec2, "run-ec2-two", said.append)) == sorted(made.instance_ids)
    assert owned_instances(ec2, "run-ec2-two", ["pending", "running", "shutting-down"]) == []


def _capacity_error(request, **kwargs):
    """What EC2 answers when a zone has none of a type: HTTP 500, its XML error."""
    from botocore.awsrequest import AWSResponse

    body = request.body.decode() if isinstance(request.body, bytes) else str(request.body)
    if "InstanceType=g6.xlarge" not in body:
        return None
    xml = (
        b'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
        b"<Code>InsufficientInstanceCapacity</Code><Message>We currently do not have"
        b" sufficient g6.xlarge capacity in the Availability Zone you requested"
        b" (us-east-1a).</Message></Error></Errors><RequestID>0</RequestID></Response>"
    )

    class Raw:
        def stream(self, **_):
            yield xml

    return AWSResponse(request.url, 500, {"Content-Type": "text/xml"}, Raw())


def test_a_capacity_error_moves_to_the_next_offer_and_says_so(ec2):
    ec2.meta.events.register("before-send.ec2.RunInstances", _capacity_error)
    owner = owner_labels("run-ec2-capacity", "ec2-test")
    said: list[str] = []
    offers = [offer("g6.xlarge"), offer("g6.2xlarge", zone="us-east-1b")]
    made = launch(ec2, offers, 1, 50, image(ec2), USER_DATA, owner, said.append)
    assert made.offer is not None and made.offer.instance_type == "g6.2xlarge"
    assert said[0] == (
        "no g6.xlarge (on-demand) in us-east-1a (InsufficientInstanceCapacity); trying the"
        " next offer"
    )
    [instance] = owned_instances(ec2, "run-ec2-capacity")
    assert instance["InstanceType"] == "g6.2xlarge"
    remove(ec2, "run-ec2-capacity", said.append)
    with pytest.raises(CapacityError) as none_left:
        launch(ec2, [offer("g6.xlarge")], 1, 50, image(ec2), USER_DATA, owner, said.append)
    assert "g6.xlarge on-demand in us-east-1a: InsufficientInstanceCapacity" in str(none_left.value)
    assert owned_instances(ec2, "run-ec2-capacity") == []


def _error(status: int, code: str):
    from botocore.awsrequest import AWSResponse

    xml = (
        f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
        f"<Message>{code}</Message></Error></Errors><RequestID>0</RequestID></Response>"
    ).encode()

    class Raw:
        def stream(self, **_):
            yield xml

    return lambda request: AWSResponse(request.url, status, {"Content-Type": "text/xml"}, Raw())


def test_throttling_and_503_are_retried_without_a_second_instance(ec2):
    """EC2 answers RunInstances with RequestLimitExceeded twice, then 503 once (botocore's
    before-send event, nothing patched in gpuflow): the launch backs off, retries, and
    makes exactly one instance."""
    answers = [_error(503, "RequestLimitExceeded")] * 2 + [_error(503, "ServiceUnavailable")]
    calls: list[str] = []

    def flaky(request, **kwargs):
        calls.append("RunInstances")
        return answers.pop(0)(request) if answers else None

    ec2.meta.events.register("before-send.ec2.RunInstances", flaky)
    owner = owner_labels("run-ec2-throttled", "ec2-test")
    said: list[str] = []
    made = launch(ec2, [offer("g6.xlarge")], 1, 50, image(ec2), USER_DATA, owner, said.append)
    assert len(made.instance_ids) == 1 and len(calls) == 4
    assert [i["InstanceId"] for i in owned_instances(ec2, "run-ec2-throttled")] == made.instance_ids
    remove(ec2, "run-ec2-throttled", said.append)


def test_reap_terminates_only_the_instances_of_runs_that_are_over(
    ec2, prefect_api, gpuflow_home, capsys
):
    """Three runs' instances: one whose flow run completed, one still running, one the API
    never heard of. --dry-run lists the two that are over with what they cost an hour and
    touches nothing; reap then terminates exactly those."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpuflow.cli import main

    @flow(name="ec2-reap-done")
    def done_flow() -> None:
        pass

    finished = str(done_flow(return_state=True).state_details.flow_run_id)
    with get_client(sync_client=True) as client:
        running = str(client.create_flow_run(done_flow, state=Running()).id)
    unknown = "6f1c54d2-9b8e-4c53-8f3a-2d2b9c1e0a77"
    made = {}
    for run_id, kind in ((finished, "g6.xlarge"), (running, "g6.xlarge"), (unknown, "p5.48xlarge")):
        made[run_id] = launch(
            ec2, [offer(kind)], 1, 50, image(ec2), USER_DATA, owner_labels(run_id, "reap"), print
        ).instance_ids
    capsys.readouterr()
    assert main(["reap", "--backend", "ec2", "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert (
        f"would terminate 1 instance(s) of run {finished} ({made[finished][0]}; its flow run is completed; $0.81/h)"
        in said
    )
    assert f"of run {unknown} ({made[unknown][0]}; its flow run is unknown; $98.32/h)" in said
    assert running not in said
    assert "would terminate 2 instance(s) of 2 run(s) that are over, $99.12/h" in said
    for run_id in made:  # a dry run touches nothing
        assert owned_instances(ec2, run_id) != []
    assert main(["reap", "--backend", "ec2"]) == 0
    assert owned_instances(ec2, finished) == [] and owned_instances(ec2, unknown) == []
    assert [i["InstanceId"] for i in owned_instances(ec2, running)] == made[running]
    remove(ec2, running, print)


def test_a_spot_price_limit_is_the_spot_requests_max_price(ec2):
    """placement.spot_price_limit reaches EC2 as the spot request's MaxPrice (without it,
    EC2's default cap: the on-demand price)."""
    sent: list[dict] = []
    ec2.meta.events.register(
        "provide-client-params.ec2.RunInstances", lambda params, **_: sent.append(params)
    )
    owner = owner_labels("run-ec2-max-price", "ec2-test")
    made = launch(
        ec2, [offer("g6.xlarge", market="spot")], 1, 50, image(ec2), USER_DATA, owner,
        lambda _line: None, max_price=0.5,
    )  # fmt: skip
    try:
        options = sent[0]["InstanceMarketOptions"]["SpotOptions"]
        assert options["MaxPrice"] == "0.5000" and options["SpotInstanceType"] == "one-time"
    finally:
        remove(ec2, "run-ec2-max-price", lambda _line: None)
    assert made.instance_ids
