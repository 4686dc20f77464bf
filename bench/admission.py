"""Admission decisions per second (tasks/platform/quotas.py, tasks/platform/admission.py).

1,000 runs queued by 50 users in 10 teams (quotas of 4 to 16 GPUs, runs of 1 to 8 GPUs, a
few priorities), then runs end one at a time and the queue is decided again after each,
as the waiting runs' processes do: `decide` alone (the rules), and a whole round of the
ledger as a waiting run does it (the lock, reading and writing the JSON ledger, deciding).
Kueue's published simulation admits about 42 workloads a second over 1,000 queues; each
decision here places every waiting run (its state, position and reason).

    python bench/admission.py [--runs 1000] [--users 50] [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from gpuflow.tasks.platform.admission import Ledger, entries_of
from gpuflow.tasks.platform.quotas import ANYWHERE, Entry, Quotas, decide


def workload(runs: int, users: int, seed: int = 11) -> tuple[list[Entry], Quotas]:
    chance = random.Random(seed)
    teams = [f"team{t}" for t in range(10)]
    quotas = Quotas(
        teams={team: {ANYWHERE: chance.choice([4, 8, 16])} for team in teams},
        caps={},
        team_of={f"user{u}": teams[u % len(teams)] for u in range(users)},
    )
    entries = [
        Entry(
            run=f"{i:08d}-run",
            user=(user := f"user{chance.randrange(users)}"),
            team=quotas.team_of[user],
            gpus=chance.choice([1, 1, 2, 4, 8]),
            scope=ANYWHERE,
            since=float(i),
            priority=chance.choice([0, 0, 0, 10]),
        )
        for i in range(runs)
    ]
    return entries, quotas


def rules(entries: list[Entry], quotas: Quotas, rounds: int) -> tuple[float, int]:
    """Return seconds per decision and how many runs were admitted over `rounds` ends."""
    entries = decide(entries, quotas)
    admitted, spent = 0, 0.0
    chance = random.Random(3)
    for _ in range(rounds):
        holding = [e for e in entries if e.state in ("admitted", "borrowed")]
        ending = chance.choice(holding)
        entries = [e for e in entries if e.run != ending.run]
        started = time.perf_counter()
        entries = decide(entries, quotas)
        spent += time.perf_counter() - started
        admitted += sum(1 for e in entries if e.state in ("admitted", "borrowed")) - (
            len(holding) - 1
        )
    return spent / rounds, admitted


def ledger_rounds(entries: list[Entry], quotas: Quotas, rounds: int) -> float:
    """Return seconds per round of the ledger as a waiting run (or the admitter) does it:
    the runs holding GPUs have a process, the waiting ones are parked (none)."""
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(Path(tmp))
        me = {"pid": os.getpid(), "started": __import__("psutil").Process().create_time()}
        parked = {"pid": None, "started": None}
        placed = decide(entries, quotas)
        with ledger.changing() as rows:
            rows[:] = [{**asdict(e), **(parked if e.state == "queued" else me)} for e in placed]
        started = time.perf_counter()
        for _ in range(rounds):
            with ledger.changing() as rows:
                extra = {row["run"]: {"pid": row["pid"], "started": row["started"]} for row in rows}
                decided = decide(entries_of(rows), quotas)
                rows[:] = [{**asdict(e), **extra[e.run]} for e in decided]
        return (time.perf_counter() - started) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    entries, quotas = workload(args.runs, args.users)
    per_decision, admitted = rules(entries, quotas, args.rounds)
    per_round = ledger_rounds(entries, quotas, max(20, args.rounds // 5))
    waiting = sum(1 for e in decide(entries, quotas) if e.state == "queued")
    print(f"{args.runs} runs of {args.users} users in 10 teams; {waiting} waiting at first")
    print(f"{'':<34} {'ms each':>9} {'per second':>11}")
    print(
        f"{'decide (every run placed)':<34} {per_decision * 1000:>9.2f} {1 / per_decision:>11.0f}"
    )
    print(
        f"{'a ledger round (lock, JSON, decide)':<34} {per_round * 1000:>9.2f} {1 / per_round:>11.0f}"
    )
    print(
        f"admissions over {args.rounds} ends: {admitted}; Kueue's simulation: about 42 a second,"
        f" here {admitted / args.rounds / per_round:.0f} a second at the ledger's pace"
    )


if __name__ == "__main__":
    main()
