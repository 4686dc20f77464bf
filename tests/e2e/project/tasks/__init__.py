"""A Prefect project's own `tasks` package, which gpuflow must never shadow."""


def greet() -> str:
    return "their-tasks"
