"""`gpuflow offers JOB.yaml`: what each candidate of the job's placement could give it now,
side by side (GPUs free now, $/h, the job's cost for limits.max_duration, whether it could
start now and why not), in the order the placement policy would try them. A single
placement on a cloud's instances (EC2, Alibaba Cloud) gets the cloud's own ranking (types,
zones, markets, prices in the cloud's currency and in USD). Makes and launches nothing."""

from __future__ import annotations

import json
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_OK, invalid, load_job_spec, number


def add(commands: Any) -> list[tuple[str, str]]:
    offers_parser = commands.add_parser(
        "offers",
        description="Show what each candidate of JOB.yaml's placement could give it now (GPUs"
        " free, $/h, the job's cost, can it start now and why not), in the order the placement"
        " policy tries them; for one placement on a cloud's instances (ec2, alibaba), its ranked"
        " types, zones and markets, priced in its currency and in USD."
        " Nothing is made or launched.",
    )
    offers_parser.add_argument("job", help="path of a job spec (YAML or JSON)")
    offers_parser.add_argument(
        "--top", type=number(1, 10_000), default=15, help="offers per candidate to print (15)"
    )
    offers_parser.add_argument("--json", action="store_true", help="print every offer as JSON")
    offers_parser.set_defaults(handler=lambda args: offers(args.job, args.top, args.json))
    return [("offers", "what each candidate could give a job now, side by side (nothing made)")]


def offers(path: str, top: int = 15, as_json: bool = False) -> int:
    """Print the ranked offers for the job at `path`."""
    from gpuflow.tasks import placement
    from gpuflow.tasks.errors import InvalidSpec

    try:
        spec = load_job_spec(path)
    except InvalidSpec as exc:
        return invalid(exc)
    from gpuflow.tasks.runscope import run_scope

    show = _print if _rents_instances(spec) and not spec.candidates else _print_pool
    with run_scope():  # each candidate's offers read once (its check asks them too)
        if not placement.needs_api(spec):
            return show(spec, top, as_json)
        return session.with_api(lambda api: show(spec, top, as_json))


def _print_pool(spec: Any, top: int, as_json: bool) -> int:
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_pool
    from gpuflow.tasks.pipeline.failover import offers_of
    from gpuflow.tasks.pipeline.pool import order

    try:
        asked = offers_of(check_pool(spec))
    except InvalidSpec as exc:
        return invalid(exc)
    ranked = order(spec.placement_policy.choose, [c for c, _ in asked])
    found = {c.index: offers for c, offers in asked}
    hours = spec.limits.max_duration / 3600
    rows: list[dict[str, Any]] = []
    for c in ranked:
        listed: list[Any] = [*found[c.index][:top]] or [None]  # None: the candidate's error
        for offer in listed:
            rows.append(
                {"candidate": c.name, "index": c.index}
                | (offer.model_dump() if offer else {"error": c.error})
                | ({"job_usd": round(offer.hourly_usd * hours, 4)} if offer else {})
            )
    if as_json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    res = spec.resources
    product = f" of {res.gpu_product}" if res.gpu_product else ""
    print(
        f"{len(ranked)} candidate(s) for {res.nodes} node(s) x {res.gpus} GPU(s){product},"
        f" tried {spec.placement_policy.choose}; job cost for limits.max_duration ({hours:g} h):"
    )
    print(
        f"  {'#':>2}  {'candidate':22} {'where':44} {'GPUs free now':28} {'$/h':>9}"
        f" {'job $':>10}  {'start now':9}  why not"
    )
    for row in rows:
        if "error" in row:
            print(
                f"  {row['index']:>2}  {row['candidate'][:22]:22} {'':44} {'?':28} {'':>9} {'':>10}  {'no':9}  {row['error']}"
            )
            continue
        free = "at launch" if row["gpus_free"] is None else str(row["gpus_free"])
        if row["gpus_free"] is not None and row["gpu_product"]:
            free += f" x {row['gpu_product']}"
        print(
            f"  {row['index']:>2}  {row['candidate'][:22]:22} {row['where'][:44]:44} {free[:28]:28}"
            f" {row['hourly_usd']:>9.3f} {row['job_usd']:>10.2f}  {'yes' if row['can_start'] else 'no':9}"
            f"  {row['why_not']}"
        )
    return EXIT_OK


def _rents_instances(spec: Any) -> bool:
    from gpuflow.tasks.backends.instances.backend import InstanceBackend
    from gpuflow.tasks.backends.registry import backend_class
    from gpuflow.tasks.errors import InvalidSpec

    try:
        return issubclass(backend_class(spec.placement.backend), InstanceBackend)
    except InvalidSpec:
        return False


def _print(spec: Any, top: int, as_json: bool) -> int:
    from gpuflow.tasks import placement
    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.errors import InvalidSpec

    backend = get_backend(spec.placement.backend, spec.placement)
    try:
        _, prices = placement.resolve(spec)
        found = backend.ranked(spec, prices)  # type: ignore[attr-defined]
        region = backend.settings.region  # type: ignore[attr-defined]
    except InvalidSpec as exc:
        return invalid(exc)
    if as_json:
        print(json.dumps([o.model_dump() for o in found], indent=1))
        return EXIT_OK
    nodes, hours = spec.resources.nodes, spec.limits.max_duration / 3600
    each = f"{nodes} x " if nodes > 1 else ""
    currency = found[0].currency if found else "USD"
    print(
        f"{len(found)} offers on {spec.placement.backend} in {region} for {each}"
        f"{spec.resources.gpus} GPU(s)"
        f"{' of ' + spec.resources.gpu_product if spec.resources.gpu_product else ''},"
        f" {spec.placement.market}; job cost for limits.max_duration ({hours:g} h):"
    )
    own = f"{currency}/h" if currency != "USD" else ""
    print(
        f"  {'#':>2}  {'instance type':22} {'zone':14} {'market':9} {'GPUs':18} {own:>9}"
        f" {'$/h':>9} {'job $':>10}"
    )
    for rank, offer in enumerate(found[:top], start=1):
        gpus = f"{offer.gpus} x {offer.product}"
        local = f"{(offer.hourly_price or 0) * nodes:>9.2f}" if own else f"{'':>9}"
        print(
            f"  {rank:>2}  {offer.instance_type[:22]:22} {offer.zone[:14]:14} {offer.market:9}"
            f" {gpus[:18]:18} {local} {offer.hourly_usd * nodes:>9.3f} {offer.job_usd:>10.2f}"
        )
    if own:
        rate = prices.usd_rate(currency)
        print(
            f"  prices in {currency}, in USD at {rate:g} USD per {currency} (the price table's rate)"
        )
    if len(found) > top:
        print(f"  ... {len(found) - top} more (--top N, or --json for all)")
    return EXIT_OK
