"""Secrets for the job's environment: read from Prefect Secret blocks, masked everywhere else."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tasks.errors import InvalidSpec

MASK = "***"


class Redactor:
    """Replaces every known secret value in text with ***."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first, so a secret that contains another is masked whole.
        self._values = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, MASK)
        return text


def resolve(secret_env: Mapping[str, str]) -> dict[str, str]:
    """Return {ENV: value} from Prefect Secret blocks; InvalidSpec names a missing block."""
    from prefect.blocks.system import Secret

    values = {}
    for env_name, block_name in secret_env.items():
        try:
            secret = Secret.load(block_name)
        except ValueError:
            raise InvalidSpec(
                f"secret_env.{env_name}: there is no Prefect Secret block named {block_name!r};"
                f" create it with Secret(value=...).save({block_name!r}) or fix the name."
            ) from None
        value = secret.get()
        values[env_name] = value if isinstance(value, str) else str(value)
    return values
