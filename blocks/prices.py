"""GpuPriceTable: what GPUs, CPU cores and disk cost, for cost reports and budgets."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field

from gpuflow.tasks.metrics.cost import PriceTable

_DEFAULT = PriceTable()


class GpuPriceTable(Block):
    """Hourly prices per GPU product and backend; a run's cost and `limits.max_cost_usd`
    use them. Prices given here replace gpuflow's built-in list prices for those products.

    Examples:
        Reserved H100s at a negotiated rate:
        ```python
        from gpuflow.blocks import GpuPriceTable
        GpuPriceTable(gpu_hourly_usd={"ec2": {"NVIDIA-H100-80GB-HBM3": 7.5}}).save("team")
        ```
        then `placement.price_table: team` in a job spec.
    """

    _block_type_name = "gpuflow GPU Price Table"
    _block_type_slug = "gpuflow-gpu-price-table"
    _description = "Hourly GPU, CPU and disk prices per backend for gpuflow's cost reports."

    gpu_hourly_usd: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {k: dict(v) for k, v in _DEFAULT.gpu_hourly_usd.items()},
        title="GPU hourly prices (USD)",
        description='Backend -> GPU product (or "*" for any) -> price of one GPU-hour.',
    )
    cpu_core_hourly_usd: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULT.cpu_core_hourly_usd),
        title="CPU core hourly prices (USD)",
        description="Backend -> price of one core-hour (CPU-only runs).",
    )
    disk_gb_month_usd: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULT.disk_gb_month_usd),
        title="Disk prices (USD per GB-month)",
        description="Backend -> price of one GB of workspace disk for a month.",
    )

    usd_per_unit: dict[str, float] = Field(
        default_factory=dict,
        title="Currency rates (USD per unit)",
        description='Currency -> what one unit of it is in USD, e.g. {"CNY": 0.14}: clouds that'
        " price in it (Alibaba Cloud, Tencent Cloud in China) are compared, capped and reported"
        " in USD at this rate.",
    )

    def table(self) -> PriceTable:
        """Return gpuflow's price table with this block's prices laid over the defaults."""
        merged = PriceTable()
        for backend, prices in self.gpu_hourly_usd.items():
            merged.gpu_hourly_usd[backend] = {**merged.gpu_hourly_usd.get(backend, {}), **prices}
        merged.cpu_core_hourly_usd.update(self.cpu_core_hourly_usd)
        merged.disk_gb_month_usd.update(self.disk_gb_month_usd)
        merged.usd_per_unit.update(self.usd_per_unit)
        return merged
