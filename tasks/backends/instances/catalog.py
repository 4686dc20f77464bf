"""A cloud's GPU instance types, where they are offered, what they cost, and which fit a
job: the same on every cloud that rents instances.

A provider reads its cloud's catalog (`Catalog`: the GPU types, the zones offering each,
spot and on-demand prices where the cloud's API gives them) in its own currency; `rank` is
pure: the offers that fit a job's resources, in the order a launch tries them (spot first
when the market allows it, cheapest first). Every failure is one sentence naming the
setting and the fix.
"""

from __future__ import annotations

import difflib
from typing import ClassVar

from pydantic import BaseModel

from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.gpus import canonical_product
from gpuflow.tasks.metrics.cost import HOURS_PER_MONTH, PriceTable
from gpuflow.tasks.spec import Resources


class GpuType(BaseModel):
    instance_type: str
    product: str
    gpus: int
    gpu_memory_mib: int
    vcpus: int
    memory_mib: int
    placement_group: bool = False  # supports a cluster placement group (EC2)


class Offer(BaseModel):
    instance_type: str
    zone: str
    market: str  # spot | on-demand
    product: str
    gpus: int
    vcpus: int
    memory_mib: int
    hourly_usd: float  # one instance and its root volume
    job_usd: float  # every node for limits.max_duration
    currency: str = "USD"  # the cloud's own
    hourly_price: float | None = None  # hourly_usd in the cloud's own currency

    def line(self, nodes: int) -> str:
        count = f"{nodes} x " if nodes > 1 else ""
        price = f"${self.hourly_usd * nodes:.3f}/h"
        if self.currency != "USD" and self.hourly_price is not None:
            price = f"{money(self.hourly_price * nodes, self.currency)}/h ({price})"
        return (
            f"{count}{self.instance_type} ({self.gpus} x {self.product}) {self.market} in"
            f" {self.zone}: {price}"
        )


def money(amount: float, currency: str) -> str:
    """`amount` as people write it: $0.800 in USD, 4.50 CNY otherwise."""
    return f"${amount:.3f}" if currency == "USD" else f"{amount:.2f} {currency}"


class Catalog(BaseModel):
    """What a cloud offers in a region, read from its API (nothing launched)."""

    types: list[GpuType]
    zones: dict[str, list[str]]  # instance type -> the zones offering it
    spot: dict[str, float] = {}  # "type zone" -> the spot price now
    # "type zone" -> the on-demand price; empty: the price table's per-GPU prices
    on_demand: dict[str, float] = {}


class CloudSettings(BaseModel):
    """Where a job may rent: a provider block's settings (defaults without one)."""

    block_type: ClassVar[str] = "block"  # the block's class, in sentences
    name: str | None = None
    region: str
    zones: list[str] = []
    families: list[str] = []
    image_id: str | None = None
    control_prefix: str | None = None
    install: str = ""
    boot_timeout_s: float = 900.0

    def field(self, setting: str) -> str:
        if self.name:
            return f"{self.block_type} {self.name!r} {setting}"
        return f"{setting} (no {self.block_type} in placement.block: defaults)"


def key(instance_type: str, zone: str) -> str:
    return f"{instance_type} {zone}"


def rank(
    ask: Ask,
    catalog: Catalog,
    prices: PriceTable,
    settings: CloudSettings,
    backend: str,
    currency: str = "USD",
    label: str = "",
) -> list[Offer]:
    """Return the offers that fit `ask.resources`, in launch order (pure). InvalidSpec when
    none fits (naming what the region has), a spot price limit is below every spot price on
    a spot-only market, or the budget buys less than an hour. `label`: the cloud's name for
    its instances in sentences (EC2, ECS, CVM)."""
    res, market = ask.resources, ask.placement.market
    types, zones = catalog.types, catalog.zones
    if res.gpus < 1:
        raise InvalidSpec(
            f"resources.gpus: the {backend} backend rents GPU instances; ask for at least 1"
            " GPU or use placement.backend: local."
        )
    product = canonical_product(res.gpu_product) if res.gpu_product else None
    _check_zones(settings, zones)
    rate = _usd_rate(ask, prices, settings, currency, label or backend)
    disk_hourly = 0.0
    if not catalog.on_demand:  # the cloud's own prices include the system disk
        disk_hourly = (
            res.disk / 2**30 * prices.disk_gb_month_usd.get(backend, 0.0) / HOURS_PER_MONTH
        )
    hours = ask.limits.max_duration / 3600.0
    fitting = [t for t in types if _fits(t, res, product)]
    if not fitting:
        raise InvalidSpec(_nothing_fits(ask, types, product, settings, label or backend))
    limit = ask.placement.spot_price_limit
    offers: list[Offer] = []
    unpriced, over_limit = set(), []
    for kind in fitting:
        for zone in zones.get(kind.instance_type, []):
            if settings.zones and zone not in settings.zones:
                continue
            if catalog.on_demand:
                on_demand = catalog.on_demand.get(key(kind.instance_type, zone), 0.0)
            else:
                on_demand = prices.gpu_hourly(backend, kind.product) * kind.gpus
            if on_demand <= 0:
                unpriced.add(kind.product)
                continue
            spot = catalog.spot.get(key(kind.instance_type, zone))
            if spot is not None and limit is not None and spot > limit:
                over_limit.append((spot, kind.instance_type, zone))
                spot = None
            for name, hourly in _markets(market, on_demand, spot):
                total = hourly + disk_hourly
                usd = total * rate
                offers.append(
                    Offer(
                        instance_type=kind.instance_type,
                        zone=zone,
                        market=name,
                        product=kind.product,
                        gpus=kind.gpus,
                        vcpus=kind.vcpus,
                        memory_mib=kind.memory_mib,
                        hourly_usd=round(usd, 6),
                        job_usd=round(usd * res.nodes * hours, 2),
                        currency=currency,
                        hourly_price=round(total, 6),
                    )
                )
    if not offers:
        raise _none_offered(ask, over_limit, unpriced, catalog, settings, currency)
    # at one price (prices are per GPU), the smallest machine that fits
    offers.sort(key=lambda o: (o.market != "spot", o.hourly_usd, o.vcpus, o.memory_mib, o.zone))
    budget = ask.limits.max_cost_usd
    cheapest = min(offers, key=lambda o: o.hourly_usd)
    if budget is not None and cheapest.hourly_usd * res.nodes > budget:
        raise InvalidSpec(
            f"limits.max_cost_usd: ${budget:g} buys less than one hour of the cheapest fitting"
            f" offer ({cheapest.line(res.nodes)}); raise it or ask for less."
        )
    return offers


def _usd_rate(
    ask: Ask, prices: PriceTable, settings: CloudSettings, currency: str, label: str
) -> float:
    """USD per unit of `currency` at the rate the user gave; InvalidSpec naming where to
    give it when there is none."""
    rate = prices.usd_rate(currency)
    if rate is None:
        raise InvalidSpec(
            f"{ask.prices_field}: {label} prices {settings.region} in {currency},"
            " and gpuflow compares, caps (limits.max_cost_usd) and reports costs in USD; give"
            f" the rate: a GpuPriceTable block with usd_per_unit: {{{currency}: <USD per"
            f" {currency}>}} named in {ask.prices_field}, or GPUFLOW_USD_PER_{currency}."
        )
    return rate


def _fits(kind: GpuType, res: Resources, product: str | None) -> bool:
    """Whether one instance of `kind` holds a node of `res` (of `product`, when named)."""
    return (
        (product is None or kind.product == product)
        and kind.gpus >= res.gpus
        and (res.memory is None or kind.memory_mib * 2**20 >= res.memory)
        and (res.cpu is None or kind.vcpus >= res.cpu)
    )


def _none_offered(
    ask: Ask,
    over_limit: list[tuple[float, str, str]],
    unpriced: set[str],
    catalog: Catalog,
    settings: CloudSettings,
    currency: str,
) -> InvalidSpec:
    """Why no offer is left although types fit: the spot price limit, a missing price, or
    no zone offering them on the market asked."""
    market, limit = ask.placement.market, ask.placement.spot_price_limit
    if over_limit:
        spot, kind_name, zone = min(over_limit)
        return InvalidSpec(
            f"placement.spot_price_limit: {money(limit or 0, currency)}/h is below the"
            f" spot price of every fitting type (the lowest: {kind_name} in {zone} at"
            f" {money(spot, currency)}/h); raise the limit, remove it or rent on-demand"
            " (placement.market: spot-then-on-demand)."
        )
    why = (
        f"no price for {', '.join(sorted(unpriced))} in the price table; add it to a"
        " GpuPriceTable block (placement.price_table)"
        if unpriced and not catalog.on_demand
        else f"{', '.join(sorted(unpriced))} has no price in any zone"
        if unpriced
        else f"no zone{' of ' + settings.field('zones') if settings.zones else ''} offers"
        f" them on the {market} market; allow other zones or placement.market:"
        " spot-then-on-demand"
    )
    return InvalidSpec(f"resources: types fit this job in {settings.region}, but {why}.")


def _check_zones(settings: CloudSettings, zones: dict[str, list[str]]) -> None:
    """Raise InvalidSpec for a zone the settings name where no GPU type is offered."""
    if not settings.zones:
        return
    known = {z for each in zones.values() for z in each}
    stray = [z for z in settings.zones if z not in known]
    if stray and known:
        raise InvalidSpec(
            f"{settings.field('zones')}: {', '.join(stray)} offer no GPU type in"
            f" {settings.region} (zones that do: {', '.join(sorted(known))}); fix the block."
        )


def _markets(market: str, on_demand: float, spot: float | None) -> list[tuple[str, float]]:
    """Return the markets an instance type in a zone is offered on, with their hourly
    prices: spot when asked and under on-demand (the cap), on-demand when asked."""
    choices = []
    if market != "on-demand" and spot is not None and spot < on_demand:
        choices.append(("spot", spot))
    if market != "spot":
        choices.append(("on-demand", on_demand))
    return choices


def _nothing_fits(
    ask: Ask, types: list[GpuType], product: str | None, settings: CloudSettings, label: str
) -> str:
    res = ask.resources
    families = f" (families {', '.join(settings.families)})" if settings.families else ""
    where = f"{settings.region}{families}"
    if product and not any(t.product == product for t in types):
        have = sorted({t.product for t in types})
        return (
            f"resources.gpu_product: no {label} instance type in {where} has {product};"
            f" types there have {', '.join(have) or 'no GPUs'}; pick one of those."
        )
    same = [t for t in types if product is None or t.product == product]
    most = max((t.gpus for t in same), default=0)
    if most < res.gpus:
        return (
            f"resources.gpus: the largest {product or 'GPU'} type in {where} has {most} GPUs;"
            f" ask for at most {most} per node and use more nodes."
        )
    return (
        f"resources: no {product or 'GPU'} type in {where} has {res.gpus} GPUs with"
        f" {res.cpu or 'any'} vCPUs and {(res.memory or 0) / 2**30:g} GiB of memory; ask for less."
    )


def nearest(name: str, known: list[str]) -> str:
    """`known` names close to `name`, for a sentence."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4) or sorted(known)[:4]
    return ", ".join(close)
