"""Secrets for the job's environment: read from Prefect Secret blocks, masked everywhere else."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.runscope import once
from gpuflow.tasks.saved_blocks import load_block

MASK = "***"
# Shorter values are not masked: "ok" or "1" would mask ordinary text everywhere.
MIN_MASKED = 4


class Redactor:
    """Replaces every known secret value in text with ***: the whole value, each of its
    lines, and each leaf of a JSON value, so a secret printed over several lines or as
    part of a structure is masked as well."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        parts: set[str] = set()
        for secret in secrets:
            parts |= _parts(secret)
        # Longest first, so a secret that contains another is masked whole.
        self._values = sorted((p for p in parts if len(p) >= MIN_MASKED), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        """Return `text` fit to show: every known secret masked, control characters
        escaped (`printable`)."""
        for value in self._values:
            text = text.replace(value, MASK)
        return printable(text)


# C0 controls but tab and newline, DEL, C1 controls and lone surrogates: a terminal obeys the
# controls (ESC starts its sequences, CR overwrites a line), PostgreSQL refuses NUL, and no
# encoder takes a lone surrogate.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str) -> str:
    """Return `text` with every control character (but tab and newline) written out as
    \\xNN (\\uNNNN for a lone surrogate): what a job prints can be stored by any
    database Prefect uses and shown on a terminal without acting on it."""
    return CONTROL.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_json(value: object) -> object:
    """Return a JSON value with every string in it (keys too) made `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [printable_json(item) for item in value]
    if isinstance(value, dict):
        return {printable(str(k)): printable_json(v) for k, v in value.items()}
    return value


def _parts(secret: str) -> set[str]:
    """Return the pieces of `secret` that may appear on their own in a line of output."""
    parts = {secret, secret.strip()}
    parts |= {line.strip() for line in secret.splitlines()}
    try:
        document = json.loads(secret)
    except ValueError:
        return parts
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            parts |= _parts(item) if item != secret else set()
        elif item is not None and not isinstance(item, bool):
            parts.add(str(item))
    return parts


def as_env_value(value: object) -> str:
    """Return a Secret block's value as an environment variable holds it: text as it is,
    anything else (a JSON object, list or number) as JSON the job can parse."""
    return value if isinstance(value, str) else json.dumps(value)


def resolve(secret_env: Mapping[str, str]) -> dict[str, str]:
    """Return {ENV: value} from Prefect Secret blocks; InvalidSpec names a missing block.
    Read once per run (tasks/runscope.py)."""
    key = ("secrets", tuple(sorted(secret_env.items())))
    return dict(once(key, lambda: _read(secret_env)))


def _read(secret_env: Mapping[str, str]) -> dict[str, str]:
    from prefect.blocks.system import Secret

    values = {}
    for env_name, block_name in secret_env.items():
        secret = load_block(
            Secret,
            block_name,
            f"secret_env.{env_name}",
            create=f"Secret(value=...).save({block_name!r})",
            kind="Prefect Secret",
        )
        value = as_env_value(secret.get())
        if len(value.strip()) < MIN_MASKED:
            raise InvalidSpec(
                f"secret_env.{env_name}: the secret in {block_name!r} is shorter than"
                f" {MIN_MASKED} characters, too short to mask in logs without masking ordinary"
                " text; use a longer secret (or env, if it need not be secret)."
            )
        values[env_name] = value
    return values
