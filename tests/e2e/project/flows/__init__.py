"""A Prefect project's own `flows` package."""
