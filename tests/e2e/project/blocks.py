"""A Prefect project's own `blocks` module, which gpuflow must never shadow."""

NAME = "their-blocks"
