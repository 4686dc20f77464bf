"""Prices and cost: pure. Hourly price per GPU by backend and product, plus disk and CPU.

Defaults are each registered backend's list prices (`ListPrices`: EC2's on-demand prices
per GPU, an instance's price divided by its GPUs); the local host costs nothing unless a
price is given.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

HOURS_PER_MONTH = 730.0


class ListPrices(BaseModel):
    """A backend's default prices (its `list_prices`, added when it is registered): per GPU
    and hour by product ("*": any product), per CPU core and hour, per GB of disk a month."""

    gpu_hourly_usd: dict[str, float] = {}
    cpu_core_hourly_usd: float = 0.0
    disk_gb_month_usd: float = 0.0


# backend -> its list prices; filled by the backend registry (no backend is named here)
LIST_PRICES: dict[str, ListPrices] = {}


def add_list_prices(backend: str, prices: ListPrices) -> None:
    """Price `backend` at `prices` in every PriceTable made from now on."""
    LIST_PRICES[backend] = prices


def remove_list_prices(backend: str) -> None:
    """Stop pricing `backend` in the PriceTables made from now on."""
    LIST_PRICES.pop(backend, None)


class PriceTable(BaseModel):
    """Prices by backend: the registered backends' list prices unless given."""

    gpu_hourly_usd: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {b: dict(p.gpu_hourly_usd) for b, p in LIST_PRICES.items()}
    )
    cpu_core_hourly_usd: dict[str, float] = Field(
        default_factory=lambda: {b: p.cpu_core_hourly_usd for b, p in LIST_PRICES.items()}
    )
    disk_gb_month_usd: dict[str, float] = Field(
        default_factory=lambda: {b: p.disk_gb_month_usd for b, p in LIST_PRICES.items()}
    )
    # what one unit of a currency is in USD ({"CNY": 0.14}): a cloud that prices in CNY is
    # compared, capped (limits.max_cost_usd) and reported in USD at this rate
    usd_per_unit: dict[str, float] = {}

    def usd_rate(self, currency: str) -> float | None:
        """Return USD per unit of `currency`: 1 for USD, the table's rate, else the setting
        GPUFLOW_USD_PER_<CURRENCY>; None when neither gives one."""
        if currency == "USD":
            return 1.0
        if currency in self.usd_per_unit:
            return self.usd_per_unit[currency]
        given = os.environ.get(f"GPUFLOW_USD_PER_{currency}", "").strip()
        try:
            rate = float(given) if given else None
        except ValueError:
            rate = None
        return rate if rate and rate > 0 else None

    def gpu_hourly(self, backend: str, product: str | None) -> float:
        """Return the hourly price of one GPU of `product` on `backend`: its own price, else
        the backend's "*" price, else 0."""
        prices = self.gpu_hourly_usd.get(backend, {})
        return prices.get(product or "", prices.get("*", 0.0))

    def with_gpu_rate(
        self, backend: str, gpu_usd: float, cpu_core_usd: float | None = None
    ) -> PriceTable:
        """Return a new table where every GPU on `backend` costs `gpu_usd` an hour (and a
        CPU core `cpu_core_usd`, when given); this one is left as it is."""
        gpu = {**self.gpu_hourly_usd, backend: {"*": gpu_usd}}
        cpu = dict(self.cpu_core_hourly_usd)
        if cpu_core_usd is not None:
            cpu[backend] = cpu_core_usd
        return self.model_copy(update={"gpu_hourly_usd": gpu, "cpu_core_hourly_usd": cpu})


class Cost(BaseModel):
    usd: float
    hourly_usd: float
    breakdown: dict[str, float]


def hourly_breakdown(
    table: PriceTable,
    backend: str,
    products: list[str],
    cpu_cores: float,
    disk_bytes: int,
) -> dict[str, float]:
    """Return what the resources cost per hour while held: gpu, cpu and disk parts.
    CPU is priced only for CPU-only runs (a GPU's price includes its host share)."""
    return {
        "gpu": sum(table.gpu_hourly(backend, p) for p in products),
        "cpu": 0.0 if products else cpu_cores * table.cpu_core_hourly_usd.get(backend, 0.0),
        "disk": disk_bytes / 1e9 * table.disk_gb_month_usd.get(backend, 0.0) / HOURS_PER_MONTH,
    }


def hourly_rate(
    table: PriceTable, backend: str, products: list[str], cpu_cores: float, disk_bytes: int
) -> float:
    """Return what the resources cost per hour while held."""
    return sum(hourly_breakdown(table, backend, products, cpu_cores, disk_bytes).values())


def run_cost(
    table: PriceTable,
    backend: str,
    products: list[str],
    cpu_cores: float,
    disk_bytes: int,
    seconds: float,
) -> Cost:
    """Return the cost of holding the resources for `seconds`, with a breakdown."""
    per_hour = hourly_breakdown(table, backend, products, cpu_cores, disk_bytes)
    hours = seconds / 3600.0
    return Cost(
        usd=sum(per_hour.values()) * hours,
        hourly_usd=sum(per_hour.values()),
        breakdown={part: price * hours for part, price in per_hour.items()},
    )


def budget_seconds(max_cost_usd: float | None, hourly_usd: float) -> float | None:
    """Return how long the job may run before it costs `max_cost_usd` (None: no limit)."""
    if max_cost_usd is None or hourly_usd <= 0:
        return None
    return max_cost_usd / hourly_usd * 3600.0
