"""Counts the blocks a pipeline loads from the Prefect API while it runs: a pytest plugin
(`-p bench.block_loads`) that wraps Prefect's block reads and prints, at the end of the
session, how many each block type had inside flow runs (the tests' own loads, outside
any flow run, are not counted).

    .venv/bin/pytest -p bench.block_loads tests/e2e/test_slurm.py -k block_sets -s

It counts at the client's edge (Block._get_block_document / _aget_block_document), the
calls that reach the API, so a block read twice is two."""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

from prefect.blocks.core import Block
from prefect.context import FlowRunContext, TaskRunContext

LOADS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()


def _in_a_run() -> bool:
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _counted(read: Any) -> Any:
    @functools.wraps(read)
    def sync(cls: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if _in_a_run():
            with _LOCK:
                LOADS[cls.__name__] += 1
        return read.__func__(cls, name, *args, **kwargs)

    return classmethod(sync)


def _counted_async(read: Any) -> Any:
    @functools.wraps(read)
    async def counted(cls: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if _in_a_run():
            with _LOCK:
                LOADS[cls.__name__] += 1
        return await read.__func__(cls, name, *args, **kwargs)

    return classmethod(counted)


def pytest_configure(config: Any) -> None:
    Block._get_block_document = _counted(Block._get_block_document)  # type: ignore[method-assign]
    Block._aget_block_document = _counted_async(Block._aget_block_document)  # type: ignore[method-assign]


def pytest_unconfigure(config: Any) -> None:
    total = sum(LOADS.values())
    parts = ", ".join(f"{kind} {count}" for kind, count in sorted(LOADS.items()))
    print(f"\nblock loads inside flow runs: {total} ({parts or 'none'})")
