"""A pool (placement as a list of candidates): the spec's bad inputs, the order each
policy tries the candidates in, where a preempted job goes, the placement table and the
sentences; pure, nothing asked of any backend."""

from __future__ import annotations

import pytest

from gpuflow import Ec2Placement, KubernetesPlacement, LocalPlacement, SlurmPlacement
from gpuflow.tasks.contract import Offer
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.pool import (
    Candidate,
    Use,
    candidate_name,
    moves_on_preempt,
    next_after,
    none_left,
    order,
    placed_line,
    table,
)
from gpuflow.tasks.spec import PlacementPolicy, load_spec

CMD = {"kind": "command", "command": ["true"]}
K8S = {"backend": "kubernetes", "namespace": "onprem"}
SLURM = {"backend": "slurm", "partition": "gpu"}
SPOT = {"backend": "ec2", "block": "fleet", "market": "spot"}

BAD = [
    ({"placement": []}, "placement: the list of candidates is empty; give at least one placement"),
    (
        {"placement": [K8S, SLURM, K8S]},
        "placement[2] is the same candidate as placement[0]; remove one",
    ),
    (
        {"placement": [K8S, {"backend": "slurm", "partiton": "gpu"}]},
        "placement[1].partiton: unknown field; did you mean 'partition'?",
    ),
    (
        {"placement": [K8S, SLURM], "placement_policy": {"choose": "cheapset"}},
        "placement_policy.choose: 'cheapset' is not one of in-order, cheapest, soonest;"
        " did you mean 'cheapest'?",
    ),
    (
        {"placement": [K8S, SLURM], "placement_policy": {"on_preempt": "nxt"}},
        "placement_policy.on_preempt: 'nxt' is not one of same, next; did you mean 'next'?",
    ),
    (
        {"placement": K8S, "placement_policy": {"choose": "cheapest"}},
        "placement_policy chooses among candidates, but placement names one",
    ),
    ({"placement": [K8S, "slurm"]}, "placement[1]: input should be a valid dictionary"),
]


@pytest.mark.parametrize(("raw", "expected"), BAD, ids=[b[1][:40] for b in BAD])
def test_a_bad_candidate_list_is_one_sentence(raw, expected):
    with pytest.raises(InvalidSpec) as refused:
        load_spec({"job": CMD, **raw})
    assert str(refused.value).startswith(expected), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_candidate_list_keeps_its_order_and_survives_a_round_trip():
    spec = load_spec({"job": CMD, "placement": [K8S, SLURM, SPOT]})
    assert [c.backend for c in spec.candidates] == ["kubernetes", "slurm", "ec2"]
    assert spec.placement == spec.candidates[0]
    assert load_spec(spec.model_dump(mode="json")) == spec
    single = load_spec({"job": CMD, "placement": SLURM})
    assert single.candidates == () and single.placement.backend == "slurm"


def candidate(index: int, name: str, hourly: float, can_start: bool, **offer) -> Candidate:
    return Candidate(
        index=index,
        name=name,
        offer=Offer(where=name, hourly_usd=hourly, can_start=can_start, **offer),
    )


POOL = [
    candidate(0, "kubernetes/onprem", 0.0, False, gpus_free=0, why_not="0 GPU(s) free"),
    candidate(1, "slurm/gpu", 2.0, True, gpus_free=8, queue_ahead=0),
    candidate(2, "ec2/fleet spot", 0.52, True, preemptible=True),
    candidate(3, "ec2/fleet on-demand", 1.2, True),
    Candidate(index=4, name="slurm/down", error="sinfo: cannot reach slurmctld"),
]

ORDERS = [
    ("in-order", [0, 1, 2, 3, 4]),
    # the cheapest that can start now first; the full one only after those that can
    ("cheapest", [2, 3, 1, 0, 4]),
    # those that can start now in the listed order, then the full one, the unknown last
    ("soonest", [1, 2, 3, 0, 4]),
]


@pytest.mark.parametrize(("choose", "expected"), ORDERS)
def test_each_policy_tries_the_candidates_in_its_order(choose, expected):
    assert [c.index for c in order(choose, POOL)] == expected


def test_soonest_puts_a_shorter_queue_first():
    queued = [
        candidate(0, "slurm/a", 1.0, True, queue_ahead=5),
        candidate(1, "slurm/b", 1.0, True, queue_ahead=0),
    ]
    assert [c.index for c in order("soonest", queued)] == [1, 0]


MOVES = [
    (PlacementPolicy(), Offer(where="spot", preemptible=True), True),
    (PlacementPolicy(), Offer(where="slurm"), False),
    (PlacementPolicy(on_preempt="same"), Offer(where="spot", preemptible=True), False),
    (PlacementPolicy(on_preempt="next"), Offer(where="slurm"), True),
    (PlacementPolicy(), None, False),
]


@pytest.mark.parametrize(("policy", "offer", "moves"), MOVES)
def test_a_preempted_job_moves_on_after_a_spot_interruption_or_when_told(policy, offer, moves):
    assert moves_on_preempt(policy, offer) is moves


def test_after_a_preemption_the_next_candidates_that_can_start_come_first():
    ranked = order("in-order", POOL)
    after_spot = next_after(ranked, ranked[2])
    # those after it first (wrapping round), the ones that can start now before the rest
    assert [c.index for c in after_spot] == [3, 1, 4, 0]


def test_the_table_shows_each_candidate_its_offer_and_verdict():
    pool = [c.model_copy() for c in POOL]
    pool[0].verdict, pool[0].reason = "given up", "4 GPU(s) busy past placement.gpu_wait"
    pool[1].verdict, pool[1].reason = "chosen", "can start now"
    rows = table(pool, PlacementPolicy(), hours=2)
    assert [r["verdict"] for r in rows] == [
        "given up",
        "chosen",
        "not needed",
        "not needed",
        "not needed",
    ]
    assert rows[1] == {
        "candidate": "[1] slurm/gpu",
        "where": "slurm/gpu",
        "gpus_free_now": "8",
        "usd_per_hour": 2.0,
        "job_usd": 4.0,
        "can_start_now": "yes",
        "why_not": "",
        "policy": "in-order",
        "verdict": "chosen",
        "reason": "can start now",
    }
    assert rows[0]["why_not"] == "0 GPU(s) free" and rows[2]["gpus_free_now"] == "at launch"
    assert rows[4]["why_not"] == "sinfo: cannot reach slurmctld"
    assert rows[4]["gpus_free_now"] == "?"


def test_the_placed_line_names_the_choice_and_what_was_not_needed():
    pool = [c.model_copy() for c in POOL[:3]]
    pool[0].verdict = "chosen"
    pool[0] = pool[0].model_copy(
        update={
            "offer": Offer(
                where="k8s", gpu_product="NVIDIA-H100-80GB-HBM3", gpus_free=8, hourly_usd=0.0
            )
        }
    )
    line = placed_line(pool[0], pool)
    assert line == (
        "placed on kubernetes/onprem: 8 x NVIDIA-H100-80GB-HBM3 free now, $0.00/h;"
        " slurm/gpu $2.00/h, ec2/fleet spot $0.52/h not needed"
    )


def test_when_none_is_left_one_sentence_names_each_candidates_reason():
    pool = [c.model_copy() for c in POOL[:2]]
    pool[0].reason = "pending for capacity past placement.gpu_wait (10 s)"
    pool[1].reason = "2 node(s) have gpu:h100:4 idle, the job needs 3"
    said = none_left(pool)
    assert said.startswith(
        "no candidate of the placement list could give the GPUs (kubernetes/onprem: pending"
        " for capacity past placement.gpu_wait (10 s); slurm/gpu: 2 node(s) have"
    )
    assert said.count(".") >= 1 and "\n" not in said


NAMES = [
    (LocalPlacement(), "local"),
    (KubernetesPlacement(namespace="gpu"), "kubernetes/gpu"),
    (KubernetesPlacement(block="onprem", namespace="gpu"), "kubernetes/onprem"),
    (SlurmPlacement(partition="a100"), "slurm/a100"),
    (Ec2Placement(block="fleet", market="spot"), "ec2/fleet spot"),
]


@pytest.mark.parametrize(("placement", "name"), NAMES)
def test_a_candidate_is_called_by_its_backend_block_and_market(placement, name):
    assert candidate_name(placement) == name


def test_what_a_candidate_held_is_priced_at_what_it_was_paid():
    use = Use(
        candidate="ec2/fleet spot",
        backend="ec2",
        ended="preempted",
        held_s=1800,
        gpus=2,
        hourly_usd=0.5,
    )
    assert use.row() == {
        "candidate": "ec2/fleet spot",
        "backend": "ec2",
        "ended": "preempted",
        "gpu_hours": 1.0,
        "usd_per_hour": 0.5,
        "cost_usd": 0.25,
    }


def node(name: str, gpus: int, product: str, ready: bool = True, cordoned: bool = False):
    return {
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


H100 = "NVIDIA-H100-80GB-HBM3"
NODES = [
    node("a", 8, H100),
    node("b", 8, H100),
    node("c", 8, H100, cordoned=True),
    node("d", 8, H100, ready=False),
    node("e", 4, "NVIDIA-L4"),
]
FREE = [
    # gpus, pods, product, used by node -> (GPUs free, pods that fit, why not)
    (8, 1, H100, {}, (16, 2, "")),
    (
        8,
        2,
        H100,
        {"a": 1},
        (
            15,
            1,
            "15 GPU(s) free on 2 node(s); 2 pod(s) of 8 x nvidia.com/gpu of NVIDIA-H100-80GB-HBM3 fit 1 now",
        ),
    ),
    (4, 3, H100, {"a": 4}, (12, 3, "")),
    (
        1,
        1,
        None,
        {"a": 8, "b": 8, "e": 4},
        (0, 0, "0 GPU(s) free on 3 node(s); 1 pod(s) of 1 x nvidia.com/gpu fit 0 now"),
    ),
    (
        1,
        1,
        "NVIDIA-A100-SXM4-80GB",
        {},
        (0, 0, "no ready schedulable node has NVIDIA-A100-SXM4-80GB"),
    ),
]


@pytest.mark.parametrize(("gpus", "pods", "product", "used", "expected"), FREE)
def test_kubernetes_offers_count_free_gpus_on_ready_schedulable_nodes(
    gpus, pods, product, used, expected
):
    from gpuflow.tasks.backends.kubernetes.pending import free_now

    assert free_now(gpus, pods, product, NODES, used) == expected


SINFO = """\
g1                                      gpu:h100:4(S:0)                                             gpu:h100:1(IDX:0)                                           mix
g2                                      gpu:h100:4(S:0)                                             gpu:h100:0                                                  idle
g3                                      gpu:h100:4(S:0)                                             gpu:h100:0                                                  down*
g4                                      gpu:l4:2(S:0)                                               gpu:l4:2(IDX:0-1)                                           alloc
"""
ROOM = [
    (1, "h100", (7, 2)),  # g3 is down: none of its GPUs
    (4, "h100", (7, 1)),
    (1, "l4", (0, 0)),
    (2, None, (7, 2)),
]


@pytest.mark.parametrize(("gpus", "kind", "expected"), ROOM)
def test_slurm_offers_count_idle_gres_on_up_nodes(gpus, kind, expected):
    from gpuflow.tasks.backends.slurm.fit import room_now

    assert room_now(SINFO, gpus, kind) == expected


def test_a_deployments_parameters_may_carry_a_candidate_list():
    """Prefect checks a deployment's parameters against the flow's schema before the flow
    reads them: a placement list passes it, an empty list does not."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import is_valid

    from gpuflow.flows.pipeline import gpu_pipeline

    schema = parameter_schema(gpu_pipeline.fn).model_dump()
    pooled = {"job": CMD, "placement": [K8S, SPOT], "placement_policy": {"choose": "soonest"}}
    assert is_valid({"spec": pooled}, schema)
    assert is_valid({"spec": {"job": CMD, "placement": K8S}}, schema)
    assert not is_valid({"spec": {"job": CMD, "placement": []}}, schema)
