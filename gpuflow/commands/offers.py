"""`gpuflow offers JOB.yaml`: the EC2 instance types, zones and markets a job would rent,
cheapest first in the order a launch tries them, with the hourly and the job's estimated
cost. Reads EC2 with the run's AWS settings; launches nothing."""

from __future__ import annotations

import json
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_OK, invalid, load_job_spec, number


def add(commands: Any) -> list[tuple[str, str]]:
    offers_parser = commands.add_parser(
        "offers",
        description="Rank the EC2 offers JOB.yaml would rent (type, zone, market, hourly and"
        " estimated job cost); nothing is launched.",
    )
    offers_parser.add_argument("job", help="path of a job spec (YAML or JSON)")
    offers_parser.add_argument(
        "--top", type=number(1, 10_000), default=15, help="how many to print (15)"
    )
    offers_parser.add_argument("--json", action="store_true", help="print every offer as JSON")
    offers_parser.set_defaults(handler=lambda args: offers(args.job, args.top, args.json))
    return [("offers", "rank the EC2 offers a job would rent (nothing launched)")]


def offers(path: str, top: int = 15, as_json: bool = False) -> int:
    """Print the ranked offers for the job at `path`."""
    from tasks import placement
    from tasks.errors import InvalidSpec

    try:
        spec = load_job_spec(path)
    except InvalidSpec as exc:
        return invalid(exc)
    if spec.placement.backend != "ec2":  # its block is another backend's: defaults here
        spec = spec.model_copy(
            update={"placement": spec.placement.model_copy(update={"block": None})}
        )
    if not placement.needs_api(spec):
        return _print(spec, top, as_json)
    return session.with_api(lambda api: _print(spec, top, as_json))


def _print(spec: Any, top: int, as_json: bool) -> int:
    from tasks import placement
    from tasks.backends.ec2.catalog import find_offers
    from tasks.errors import InvalidSpec

    try:
        _, prices = placement.resolve(spec)
        fleet, found = find_offers(spec, prices)
    except InvalidSpec as exc:
        return invalid(exc)
    if as_json:
        print(json.dumps([o.model_dump() for o in found], indent=1))
        return EXIT_OK
    nodes, hours = spec.resources.nodes, spec.limits.max_duration / 3600
    each = f"{nodes} x " if nodes > 1 else ""
    print(
        f"{len(found)} offers in {fleet.region} for {each}{spec.resources.gpus} GPU(s)"
        f"{' of ' + spec.resources.gpu_product if spec.resources.gpu_product else ''},"
        f" {spec.placement.market}; job cost for limits.max_duration ({hours:g} h):"
    )
    print(
        f"  {'#':>2}  {'instance type':16} {'zone':12} {'market':9} {'GPUs':18} {'$/h':>9} {'job $':>10}"
    )
    for rank, offer in enumerate(found[:top], start=1):
        gpus = f"{offer.gpus} x {offer.product}"
        print(
            f"  {rank:>2}  {offer.instance_type:16} {offer.zone:12} {offer.market:9}"
            f" {gpus[:18]:18} {offer.hourly_usd * nodes:>9.3f} {offer.job_usd:>10.2f}"
        )
    if len(found) > top:
        print(f"  ... {len(found) - top} more (--top N, or --json for all)")
    return EXIT_OK
