"""A job placed on a list of candidates (a pool): what each candidate offers, the order
the policy tries them in, the placement table and the sentences said about the choice.
Pure: offers in, order and words out; tasks/pipeline/failover.py does the asking."""

from __future__ import annotations

from pydantic import BaseModel

from gpuflow.tasks.contract import Offer
from gpuflow.tasks.spec import Placement, PlacementPolicy


class Candidate(BaseModel):
    """One candidate of a pool as the choice sees it."""

    index: int  # its place in the spec's placement list
    name: str  # "kubernetes/onprem", "ec2/fleet spot": what logs and events call it
    offer: Offer | None = None  # its best offer now; None when it could not be asked
    error: str = ""  # why its offers could not be read
    verdict: str = "not needed"  # chosen | given up | preempted | skipped | not needed
    reason: str = ""  # the verdict's reason, one phrase

    @property
    def can_start(self) -> bool:
        return self.offer is not None and self.offer.can_start

    @property
    def hourly_usd(self) -> float:
        return self.offer.hourly_usd if self.offer is not None else float("inf")


class Use(BaseModel):
    """What one candidate the run used held and cost: a row of the summary's split."""

    candidate: str
    backend: str
    ended: str  # completed | failed | preempted | given up
    held_s: float
    gpus: int
    hourly_usd: float

    def row(self) -> dict[str, object]:
        """Return the summary's row: GPU-hours and cost on this candidate."""
        return {
            "candidate": self.candidate,
            "backend": self.backend,
            "ended": self.ended,
            "gpu_hours": round(self.gpus * self.held_s / 3600, 6),
            "usd_per_hour": round(self.hourly_usd, 4),
            "cost_usd": round(self.hourly_usd * self.held_s / 3600, 6),
        }


def candidate_name(placement: Placement) -> str:
    """Return what a candidate is called: its backend, block or namespace, and market."""
    return placement.label()


def order(choose: str, candidates: list[Candidate]) -> list[Candidate]:
    """Return the candidates in the order they are tried.

    in-order: as listed; cheapest: those that can start now by price, then the others by
    price; soonest: those that can start now, then those with the shortest queue, each in
    the listed order. A candidate whose offers could not be read goes last (except
    in-order, where it keeps its place: provisioning says what is wrong)."""
    if choose == "in-order":
        return list(candidates)
    if choose == "cheapest":
        return sorted(
            candidates,
            key=lambda c: (c.offer is None, not c.can_start, c.hourly_usd, c.index),
        )
    return sorted(
        candidates,
        key=lambda c: (
            c.offer is None,
            not c.can_start,
            (c.offer.queue_ahead or 0) if c.offer is not None else 0,
            c.index,
        ),
    )


def moves_on_preempt(policy: PlacementPolicy, offer: Offer | None) -> bool:
    """Return True when a job preempted on a candidate with `offer` resumes on the next
    candidate: `on_preempt: next`, or by default after a spot interruption."""
    if policy.on_preempt is not None:
        return policy.on_preempt == "next"
    return offer is not None and offer.preemptible


def next_after(tried: list[Candidate], current: Candidate) -> list[Candidate]:
    """Return the candidates to try after `current` was preempted: the others in their
    order, those after it first (wrapping around), those that can start now first."""
    at = tried.index(current)
    others = tried[at + 1 :] + tried[:at]
    return sorted(others, key=lambda c: not c.can_start)


def table(candidates: list[Candidate], policy: PlacementPolicy, hours: float) -> list[dict]:
    """Return the placement table: each candidate, what it offered, the verdict and why."""
    rows = []
    for c in sorted(candidates, key=lambda c: c.index):
        offer = c.offer
        rows.append(
            {
                "candidate": f"[{c.index}] {c.name}",
                "where": offer.where if offer else "",
                "gpus_free_now": _free(offer),
                "usd_per_hour": round(offer.hourly_usd, 4) if offer else None,
                "job_usd": round(offer.hourly_usd * hours, 2) if offer else None,
                "can_start_now": "yes" if c.can_start else "no",
                "why_not": (offer.why_not if offer else c.error) or "",
                "policy": policy.choose,
                "verdict": c.verdict,
                "reason": c.reason,
            }
        )
    return rows


def _free(offer: Offer | None) -> str:
    if offer is None:
        return "?"
    if offer.gpus_free is None:
        return "at launch"
    product = f" x {offer.gpu_product}" if offer.gpu_product else ""
    return f"{offer.gpus_free}{product}"


def placed_line(chosen: Candidate, others: list[Candidate]) -> str:
    """Return the log line that says where the job was placed and what was not needed:
    "placed on kubernetes/onprem: 8 x H100 free now, $0.00/h; ec2 spot g6 $0.52/h not needed"."""
    offer = chosen.offer
    what = ""
    if offer is not None and not offer.can_start:
        line = (
            f"placing on {chosen.name}: it cannot start now ({offer.why_not}); it has its"
            " placement.gpu_wait to give the GPUs"
        )
        following = [c.name for c in others if c.verdict == "not needed"]
        return line + (f", then {following[0]} is next" if following else "")
    if offer is not None:
        free = _free(offer)
        what = (
            f": {free} free now, ${offer.hourly_usd:.2f}/h"
            if offer.gpus_free is not None
            else f": {offer.where}, ${offer.hourly_usd:.2f}/h"
        )
    line = f"placed on {chosen.name}{what}"
    spare = [c for c in others if c.verdict == "not needed"]
    if spare:
        line += "; " + ", ".join(
            f"{c.name} ${c.hourly_usd:.2f}/h" if c.offer else c.name for c in spare
        )
        line += " not needed"
    return line


def none_left(candidates: list[Candidate]) -> str:
    """Return the one sentence said when no candidate could give the GPUs."""
    said = "; ".join(
        f"{c.name}: {c.reason or c.error or 'not tried'}"
        for c in sorted(candidates, key=lambda c: c.index)
    )
    return f"no candidate of the placement list could give the GPUs ({said}); nothing was left running, and a retry tries them again."
