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
