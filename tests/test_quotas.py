"""Quotas and fair sharing as pure rules (tasks/platform/quotas.py): admitted within quota,
borrowing idle quota, a borrower asked to yield when the owner's run comes, queued with a
position and a reason, priorities in a team, a user's cap, and fair shares over a sequence
of submissions."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from gpuflow.tasks.platform.quotas import ANYWHERE, Entry, Quotas, decide

TWO_TEAMS = Quotas(
    teams={"vision": {ANYWHERE: 2}, "nlp": {ANYWHERE: 2}},
    caps={},
    team_of={"ana": "vision", "bo": "nlp"},
)


def ask(run: str, team: str, gpus: int, since: float, user: str = "", **extra) -> Entry:
    return Entry(run, user or team, team, gpus, ANYWHERE, since, **extra)


def states(entries: list[Entry]) -> dict[str, str]:
    return {e.run: e.state for e in entries}


def test_a_team_borrows_idle_quota_and_gives_it_back_when_its_owner_asks():
    first = decide([ask("a1", "vision", 2, 1)], TWO_TEAMS)
    assert states(first) == {"a1": "admitted"}
    second = decide([*first, ask("a2", "vision", 2, 2)], TWO_TEAMS)
    assert states(second) == {"a1": "admitted", "a2": "borrowed"}
    assert second[1].reason == "borrows 2 idle GPUs anywhere beyond team vision's 2"
    third = decide([*second, ask("b1", "nlp", 2, 3)], TWO_TEAMS)
    assert states(third) == {"a1": "admitted", "a2": "yield", "b1": "queued"}
    assert (
        third[2].reason
        == "team nlp's quota (2 GPUs anywhere) is lent out: waiting for a2 to give borrowed GPUs back"
    )
    assert third[2].position == 1
    # a2 stopped (exit 75) and waits again: nlp's run starts, vision's waits for GPUs
    back = [third[0], replace(third[1], state="queued"), third[2]]
    fourth = decide(back, TWO_TEAMS)
    assert states(fourth) == {"a1": "admitted", "a2": "queued", "b1": "admitted"}
    assert (
        fourth[1].reason
        == "team vision holds 2 of its 2 GPUs anywhere and the 4 of every team there are in use"
    )
    # b1 ends: a2 borrows again and resumes
    assert states(decide([fourth[0], fourth[1]], TWO_TEAMS))["a2"] == "borrowed"


def test_the_lowest_priority_then_newest_borrower_yields_first():
    quotas = Quotas(teams={"a": {ANYWHERE: 1}, "b": {ANYWHERE: 3}}, caps={}, team_of={})
    held = [
        ask("own", "a", 1, 0, state="admitted"),
        ask("old", "a", 1, 1, state="borrowed"),
        ask("new", "a", 1, 2, state="borrowed"),
        ask("low", "a", 1, 3, state="borrowed", priority=-1),
    ]
    after = decide([*held, ask("b1", "b", 2, 4)], quotas)
    assert states(after) == {"own": "admitted", "old": "borrowed", "new": "yield"} | {
        "low": "yield",
        "b1": "queued",
    }


def test_priorities_order_a_team_and_no_run_jumps_its_own_teams_queue():
    quotas = Quotas(teams={"a": {ANYWHERE: 2}}, caps={}, team_of={})
    entries = [
        ask("held", "a", 2, 0, state="admitted"),
        ask("big", "a", 2, 1),
        ask("urgent", "a", 1, 2, priority=10),
        ask("small", "a", 1, 3),
    ]
    after = {e.run: e for e in decide(entries, quotas)}
    assert [after[r].position for r in ("urgent", "big", "small")] == [1, 2, 3]
    assert after["small"].reason == "behind urgent of team a"


def test_a_users_cap_holds_within_its_team():
    quotas = Quotas(teams={"a": {ANYWHERE: 8}}, caps={"ana": 2}, team_of={"ana": "a"})
    after = decide([ask("r1", "a", 2, 0, "ana"), ask("r2", "a", 1, 1, "ana")], quotas)
    assert states(after) == {"r1": "admitted", "r2": "queued"}
    assert after[1].reason == "ana holds 2 of its 2-GPU cap"


def test_a_run_counts_against_its_teams_most_specific_quota():
    quotas = Quotas(
        teams={"vision": {"gpu:H100": 8, "backend:fleet": 16, ANYWHERE: 2}},
        caps={},
        team_of={},
    )
    assert quotas.scope_for("vision", "H100", "fleet") == "gpu:H100"
    assert quotas.scope_for("vision", "L4", "fleet") == "backend:fleet"
    assert quotas.scope_for("vision", None, "slurm") == ANYWHERE
    assert quotas.scope_for("nobody", "H100", "fleet") == ANYWHERE


def test_fair_sharing_gives_each_team_its_share_over_a_sequence_of_submissions():
    """Three teams with quotas 4, 2 and 2 of 8 GPUs, each always with more 1-GPU runs
    waiting than it could run, runs ending at random: over 2,000 admissions each team's
    part of the GPU-time is its quota's part within 5 points."""
    quotas = Quotas(teams={"a": {ANYWHERE: 4}, "b": {ANYWHERE: 2}, "c": {ANYWHERE: 2}},
                    caps={}, team_of={})  # fmt: skip
    chance = random.Random(7)
    entries: list[Entry] = []
    clock, made, held_time = 0.0, 0, Counter()
    for _ in range(2000):
        for team in "abc":  # each team keeps 6 runs waiting
            while sum(1 for e in entries if e.team == team and e.state == "queued") < 6:
                made += 1
                entries.append(ask(f"{team}{made}", team, 1, clock))
                clock += 0.001
        entries = decide(entries, quotas)
        holding = [e for e in entries if e.state in ("admitted", "borrowed")]
        for entry in holding:
            held_time[entry.team] += 1
        ending = chance.choice(holding)
        entries = [e for e in entries if e.run != ending.run]
        clock += 1
    total = sum(held_time.values())
    parts = {team: held_time[team] / total for team in "abc"}
    assert abs(parts["a"] - 0.5) < 0.05 and abs(parts["b"] - 0.25) < 0.05
    assert abs(parts["c"] - 0.25) < 0.05, parts
