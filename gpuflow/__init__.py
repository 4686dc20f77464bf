"""gpuflow: GPU work as Prefect pipelines."""

__version__ = "0.1.0"
