"""An elastic fleet's growth plan (pure) and its block's checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuflow.blocks.gpu_fleet import FleetEc2
from gpuflow.tasks.backends.elastic import Want, plan_growth


def want(run: str, gpus: int = 1, nodes: int = 1, since: float = 0.0) -> Want:
    return Want(run=run, gpus=gpus, nodes=nodes, since=since, until=1e12)


def test_two_runs_waiting_for_one_gpu_each_launch_what_they_need_together():
    wants = [want("a"), want("b")]
    assert plan_growth(wants, 0, 0, 3, 1, 100.0, 5.0)[0] == 2
    assert plan_growth(wants, 2, 2, 3, 1, 100.0, 5.0)[0] == 0  # two booting already serve them
    assert plan_growth(wants, 1, 1, 3, 1, 100.0, 5.0)[0] == 1


def test_one_gpu_runs_share_an_instance_of_four_and_multi_node_runs_take_one_each():
    assert plan_growth([want(r) for r in "abc"], 0, 0, 3, 4, 100.0, 0.0)[0] == 1
    assert plan_growth([want("a", gpus=4, nodes=2)], 0, 0, 3, 4, 100.0, 0.0)[0] == 2


def test_growth_never_goes_above_max_and_says_so():
    count, why = plan_growth([want(r) for r in "abcde"], 0, 2, 3, 1, 100.0, 0.0)
    assert count == 1
    count, why = plan_growth([want(r) for r in "abcde"], 1, 3, 3, 1, 100.0, 0.0)
    assert count == 0 and "at its max of 3" in why


def test_a_run_that_has_not_waited_long_enough_or_gave_up_grows_nothing():
    assert plan_growth([want("a", since=98.0)], 0, 0, 3, 1, 100.0, 5.0)[0] == 0
    stale = Want(run="a", gpus=1, nodes=1, since=0.0, until=50.0)
    assert plan_growth([stale], 0, 0, 3, 1, 100.0, 5.0)[0] == 0


@pytest.mark.parametrize(
    ("nodes", "said"),
    [
        ({"min": 3, "max": 2}, "min (3) is above max (2); set min to at most 2"),
        ({"min": 0, "max": 0}, "max is 0: the fleet could never have an instance"),
    ],
)
def test_bad_nodes_are_one_sentence(nodes, said):
    with pytest.raises(ValidationError, match=said.replace("(", r"\(").replace(")", r"\)")):
        FleetEc2(block="b", instance_types=["g6.xlarge"], nodes=nodes)


def test_an_instance_type_that_is_not_one_is_named():
    with pytest.raises(ValidationError, match="'g6' is not an EC2 instance type"):
        FleetEc2(block="b", instance_types=["g6"])


def test_an_instance_costs_its_hours_and_its_idle_cost_is_the_hours_no_claim_used():
    from datetime import UTC, datetime

    from gpuflow.tasks.backends.elastic import Instance, cost_of

    launched = datetime(2026, 1, 1, tzinfo=UTC)
    instance = Instance(id="i-1", gpus=4, launched_at=launched, hourly_usd=2.0)
    cost = cost_of(instance, {"used_gpu_s": 4 * 3600.0}, launched.timestamp() + 3 * 3600)
    assert cost["hours"] == 3 and cost["used_hours"] == 1
    assert cost["cost_usd"] == 6.0 and cost["idle_cost_usd"] == 4.0


def test_the_scaler_keeps_a_busy_young_or_last_instance_and_ends_an_idle_one():
    from gpuflow.tasks.backends.fleet.growth import kept_because

    section = FleetEc2(
        block="b", instance_types=["g6.xlarge"], nodes={"min": 1, "max": 3}, idle_duration_s=60
    )
    idle = {"runs": [], "usage": {}}
    assert kept_because({"error": "fleet host i-1: refused"}, 999, section, 3) == (
        "fleet host i-1: refused"
    )
    assert kept_because({"runs": [{"name": "r"}]}, 999, section, 3) == "1 run(s) hold its GPUs"
    assert kept_because(idle, 30, section, 3) == "idle 30 s of idle_duration 60 s"
    assert kept_because(idle, 90, section, 1) == "the fleet's min is 1"
    assert kept_because(idle, 90, section, 2) is None
