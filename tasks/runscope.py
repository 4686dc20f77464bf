"""What one run reads once: a scope, from the CLI's (or the Python API's) checks to the
flow's teardown, in which the spec's checks, each backend object (and so its block) and
the run's secrets are made the first time they are asked for and handed back after.
Outside a scope (a reaper, a preflight, a test) each call makes its own, as before.

The scope is a context variable: the flow, its tasks and their threads see the scope of
the code that called the flow (Prefect copies the context into them)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Scope:
    """One run's scope, entered with `with` (where several runs are checked first, then
    run: each its own, entered for its check and again for its run)."""

    def __init__(self) -> None:
        self.made: dict[Hashable, Any] = {}
        self.lock = threading.RLock()
        self._tokens: list[contextvars.Token[Scope | None]] = []

    def __enter__(self) -> Scope:
        self._tokens.append(_SCOPE.set(self))
        return self

    def __exit__(self, *_: object) -> None:
        _SCOPE.reset(self._tokens.pop())


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "gpuflow_run_scope", default=None
)


@contextlib.contextmanager
def run_scope() -> Iterator[None]:
    """Read what a run needs once until this ends (inside a scope already: that one)."""
    if _SCOPE.get() is not None:
        yield
        return
    with Scope():
        yield


def once(key: Hashable, make: Callable[[], T]) -> T:
    """Return what `make()` gave for `key` in this run's scope, making it the first time
    (an exception is not kept: the next ask tries again); outside a scope, `make()`."""
    scope = _SCOPE.get()
    if scope is None:
        return make()
    with scope.lock:  # units in threads of their own ask at once: one of them makes it
        if key not in scope.made:
            scope.made[key] = make()
        return scope.made[key]


def remember(key: Hashable, value: Any) -> None:
    """Keep `value` for `key` in this run's scope (outside one: nothing)."""
    scope = _SCOPE.get()
    if scope is not None:
        with scope.lock:
            scope.made.setdefault(key, value)


def recall(key: Hashable) -> Any:
    """Return what this run's scope keeps for `key`, or None (outside one: None)."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    with scope.lock:
        return scope.made.get(key)
