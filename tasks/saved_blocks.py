"""Loading a saved Prefect block by name, with the one sentence when there is none."""

from __future__ import annotations

from typing import TypeVar

from gpuflow.tasks.errors import GpuflowError, InvalidSpec

BlockType = TypeVar("BlockType")


def load_block(
    block_type: type[BlockType],
    name: str,
    field: str,
    *,
    create: str | None = None,
    otherwise: str = "fix the name",
    kind: str | None = None,
    error: type[GpuflowError] = InvalidSpec,
) -> BlockType:
    """Return the `block_type` block saved as `name`. When none is: `error` saying that
    `field` names no such block, how to create one (`create`, by default
    `<Type>(...).save(name)`) and what else to do (`otherwise`)."""
    try:
        return block_type.load(name)  # type: ignore[attr-defined]
    except ValueError:
        kind = kind or block_type.__name__
        how = create or f"{block_type.__name__}(...).save({name!r})"
        raise error(
            f"{field}: there is no {kind} block named {name!r}; create it with {how} or"
            f" {otherwise}."
        ) from None
