"""GPU quotas on a shared platform, and who is admitted next: pure rules, no I/O.

Every team has a nominal GPU quota per scope: `*` (anywhere), `backend:NAME` (one backend
or pool candidate) or `gpu:PRODUCT` (H100, L4, ...); a user may have a cap of its own. A
run asks for its GPUs (gpus x nodes) in the most specific scope its team has a quota for
(its GPU product, then its backend, then anywhere). All teams' nominal quotas in a scope
form that scope's cohort, as in Kueue: what a team leaves idle, others may borrow.

`decide` takes every run that holds or waits for GPUs and returns each one's new state:

- admitted: it fits its team's nominal quota (and its user's cap);
- borrowed: it does not, but the cohort has idle quota: it runs on GPUs another team lends;
- yield: a borrowed run asked to give its GPUs back, because their owner's run fits the
  owner's nominal quota and the cohort is full: it stops through the job contract
  (SIGTERM, its grace, a checkpoint, exit 75) and waits again (lowest priority, then the
  newest, yield first);
- queued: it waits, with its position and the reason, one sentence.

Order among the waiting (the rule chosen): within a team by priority, then by age; between
teams, fair sharing by dominant share, as dominant resource fairness reduces to with GPUs
as the one resource: the team whose GPUs held (admitted and borrowed) are the smallest part
of its nominal quota goes first, recomputed after each admission; ties by the oldest head.
A team's head that cannot start holds back that team's later runs (no run jumps its own
team's queue), not other teams'.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

ANYWHERE = "*"
HOLDING = ("admitted", "borrowed", "yield")


@dataclass(frozen=True)
class Quotas:
    """The platform's quotas: team -> scope -> nominal GPUs; user -> cap; user -> team."""

    teams: dict[str, dict[str, int]]
    caps: dict[str, int]
    team_of: dict[str, str]

    def scope_for(self, team: str, product: str | None, backend: str | None) -> str:
        """Return the scope a run of `team` counts against: its most specific quota."""
        mine = self.teams.get(team, {})
        for scope in (f"gpu:{product}" if product else "", f"backend:{backend}" if backend else ""):
            if scope and scope in mine:
                return scope
        return ANYWHERE

    def nominal(self, team: str, scope: str) -> int:
        return self.teams.get(team, {}).get(scope, 0)

    def cohort(self, scope: str) -> int:
        return sum(quota.get(scope, 0) for quota in self.teams.values())


@dataclass(frozen=True)
class Entry:
    """One run that holds GPUs or waits for them."""

    run: str
    user: str
    team: str
    gpus: int
    scope: str
    since: float
    priority: int = 0
    state: str = "queued"  # queued | admitted | borrowed | yield
    reason: str = ""
    position: int = 0  # 1 for the next to start, among the queued
    reclaiming: bool = False  # queued only until borrowers asked to yield give GPUs back


def decide(entries: list[Entry], quotas: Quotas) -> list[Entry]:
    """Return every entry with its new state (see the module's text); pure."""
    held = {e.run: e for e in entries if e.state in HOLDING}
    used: dict[tuple[str, str], int] = defaultdict(int)  # (team, scope) -> GPUs held
    in_scope: dict[str, int] = defaultdict(int)  # scope -> GPUs held by everyone
    by_user: dict[str, int] = defaultdict(int)
    for entry in held.values():
        used[entry.team, entry.scope] += entry.gpus
        in_scope[entry.scope] += entry.gpus
        by_user[entry.user] += entry.gpus
    waiting: dict[str, list[Entry]] = defaultdict(list)
    for entry in sorted(entries, key=lambda e: (-e.priority, e.since, e.run)):
        if entry.state == "queued":
            waiting[entry.team].append(entry)
    decided: dict[str, Entry] = {}
    blocked: dict[str, Entry] = {}  # team -> its head that cannot start now
    holding: dict[str, int] = defaultdict(int)  # team -> GPUs held, every scope
    for (owner, _), gpus in used.items():
        holding[owner] += gpus
    nominals = {team: sum(quota.values()) for team, quota in quotas.teams.items()}

    def share(team: str) -> float:  # the part of its nominal quota a team holds
        return holding[team] / nominals[team] if nominals.get(team) else float("inf")

    while waiting:
        team = min(waiting, key=lambda t: (share(t), waiting[t][0].since))
        head = waiting[team].pop(0)
        if not waiting[team]:
            del waiting[team]
        if team in blocked:
            behind = f"behind {blocked[team].run} of team {team}"
            decided[head.run] = replace(head, reason=behind, reclaiming=False)
            continue
        verdict = _admit(head, quotas, used, in_scope, by_user, held)
        decided[head.run] = verdict
        if verdict.state in ("admitted", "borrowed"):
            used[team, head.scope] += head.gpus
            holding[team] += head.gpus
            in_scope[head.scope] += head.gpus
            by_user[head.user] += head.gpus
        else:
            blocked[team] = head
    waits = [run for run, entry in decided.items() if entry.state == "queued"]
    positions = {run: index + 1 for index, run in enumerate(waits)}
    return [
        replace(decided[e.run], position=positions.get(e.run, 0))
        if e.run in decided
        else held[e.run]
        for e in entries
    ]


def _admit(
    entry: Entry,
    quotas: Quotas,
    used: dict[tuple[str, str], int],
    in_scope: dict[str, int],
    by_user: dict[str, int],
    held: dict[str, Entry],
) -> Entry:
    """Return `entry` admitted, borrowing, or queued with its reason; borrowers it needs
    back are marked to yield in `held`."""
    scope, gpus, team = entry.scope, entry.gpus, entry.team
    cap = quotas.caps.get(entry.user)
    if cap is not None and by_user[entry.user] + gpus > cap:
        return replace(
            entry,
            reason=f"{entry.user} holds {by_user[entry.user]} of its {cap}-GPU cap",
        )
    nominal, cohort = quotas.nominal(team, scope), quotas.cohort(scope)
    mine, everyone = used[team, scope], in_scope[scope]
    where = "anywhere" if scope == ANYWHERE else scope
    if mine + gpus <= nominal:
        if everyone + gpus <= cohort:
            return replace(entry, state="admitted", reason=f"within team {team}'s quota")
        asked = _reclaim(entry, everyone + gpus - cohort, held, quotas)
        return replace(
            entry,
            reason=f"team {team}'s quota ({nominal} GPUs {where}) is lent out: {asked}",
            reclaiming=True,
        )
    if everyone + gpus <= cohort:
        return replace(
            entry,
            state="borrowed",
            reason=f"borrows {mine + gpus - nominal} idle GPUs {where} beyond team {team}'s"
            f" {nominal}",
        )
    return replace(
        entry,
        reason=f"team {team} holds {mine} of its {nominal} GPUs {where} and the"
        f" {cohort} of every team there are in use",
    )


def _reclaim(entry: Entry, short: int, held: dict[str, Entry], quotas: Quotas) -> str:
    """Mark borrowed runs in `entry`'s scope to yield until `short` GPUs come back (the
    lowest priority, then the newest, first); return what was asked, one clause."""
    yielding = [e for e in held.values() if e.scope == entry.scope and e.state == "yield"]
    short -= sum(e.gpus for e in yielding)
    borrowers = sorted(
        (e for e in held.values() if e.scope == entry.scope and e.state == "borrowed"),
        key=lambda e: (e.priority, -e.since),
    )
    for borrower in borrowers:
        if short <= 0:
            break
        held[borrower.run] = replace(
            borrower, state="yield", reason=f"gives its borrowed GPUs back to team {entry.team}"
        )
        yielding.append(borrower)
        short -= borrower.gpus
    names = ", ".join(e.run[:8] for e in yielding) or "nothing borrowed to take back"
    return f"waiting for {names} to give borrowed GPUs back"
