"""`gpuflow secret set NAME`: a Prefect Secret block saved on the API gpuflow's own commands
use (the one `secret_env` is read from), its value read from standard input, never from the
command line (where `ps` shows it to every user of the machine)."""

from __future__ import annotations

import getpass
import re
import sys
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_OK, invalid

BLOCK_NAME = re.compile(r"[a-z0-9-]+")  # what Prefect takes as a block's name


def add(commands: Any) -> list[tuple[str, str]]:
    secret = commands.add_parser(
        "secret",
        description="Save a Prefect Secret block where gpuflow reads secret_env from: the API"
        " this command names on its first line (the platform when it runs). The value is read"
        " from standard input (a prompt on a terminal), never from the command line.",
    )
    secret.add_argument("action", choices=["set"])
    secret.add_argument("name", help="the block's name: lowercase letters, digits and dashes")
    secret.set_defaults(handler=lambda args: set_secret(args.name))
    return [("secret set NAME", "save a Secret block (value from stdin) where gpuflow reads it")]


def set_secret(name: str) -> int:
    """Save the Secret block `name` with the value on standard input; say where it went."""
    from gpuflow.tasks.secrets import MIN_MASKED

    if not BLOCK_NAME.fullmatch(name):
        return invalid(
            f"NAME: {name!r} is not a name Prefect takes for a block; use lowercase letters,"
            " digits and dashes (for example lab-key)"
        )
    if sys.stdin.isatty():
        value = getpass.getpass(f"value of the Secret {name} (not shown): ")
    else:
        value = sys.stdin.read().removesuffix("\n")
    if not value.strip():
        return invalid(
            "the value is empty; give it on standard input, for example"
            f" `gpuflow secret set {name} < key.txt`"
        )
    if len(value.strip()) < MIN_MASKED:
        return invalid(
            f"the value is shorter than {MIN_MASKED} characters, too short to mask in logs"
            " without masking ordinary text; use a longer secret"
        )

    def save(api: Any) -> int:
        from prefect.blocks.system import Secret

        Secret(value=value).save(name, overwrite=True)
        print(
            f"saved the Secret block {name} on {api.describe()}; a spec reads it as"
            f" secret_env: {{VARIABLE: {name}}}"
        )
        return EXIT_OK

    return session.with_api(save)
