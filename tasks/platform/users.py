"""The people and service accounts of a shared platform, and their roles.

An admin (the platform's owner on its host, with `gpuflow platform user ...`) makes each
user a token, shown once: the user sends `NAME:TOKEN` as Prefect's auth string
(PREFECT_API_AUTH_STRING, the UI's login), and the platform's front
(tasks/platform/access.py) lets the request through with that user's role. The book is
`$GPUFLOW_HOME/platform/users.json` (0600): each user's role, kind, when it was made and
revoked, and the SHA-256 of its token (never the token). The server reads it again when
the file changes, so a revocation holds from the next request.

Roles, each the one before and more:

- viewer: reads runs, deployments, logs, events, blocks (without secret values);
- member: also creates runs, and cancels, retries, changes and deletes its own;
- admin: everything, Secret values, blocks, pools and deployments included.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import make_dirs, read_private, write_atomic

ROLES = ("viewer", "member", "admin")  # each may do what the one before may, and more
KINDS = ("person", "service")
NAME = re.compile(r"[a-z][a-z0-9._-]{0,62}")
RESERVED = ("gpuflow", "owner")  # the platform's own string; the platform's runs' owner
TOKEN_PREFIX = "gfu_"
OWNER_TAG = "owner:"  # a run's Prefect tag naming the user who made it


def owner_tag(name: str) -> str:
    return f"{OWNER_TAG}{name}"


def owner_of(tags: list[str] | None) -> str | None:
    """Return the user a run's tags name as its owner (None: the platform's own run)."""
    for tag in tags or ():
        if tag.startswith(OWNER_TAG):
            return tag[len(OWNER_TAG) :]
    return None


def at_least(role: str, wanted: str) -> bool:
    return ROLES.index(role) >= ROLES.index(wanted)


@dataclass(frozen=True)
class User:
    name: str
    role: str
    kind: str  # person | service (CI)
    digest: str  # SHA-256 of the token, hex
    created: float
    revoked: float | None = None
    team: str | None = None  # whose GPU quota its runs count against (tasks/platform/quotas.py)


class Refused(Exception):
    """A request the platform's front refuses: its HTTP status and one sentence."""

    def __init__(self, status: int, sentence: str) -> None:
        super().__init__(sentence)
        self.status, self.sentence = status, sentence


def check_name(name: str, what: str = "user") -> str:
    if not NAME.fullmatch(name):
        raise InvalidSpec(
            f"{what} name {name!r} is not 1-63 lower-case letters, digits, '.', '_' or '-'"
            f" starting with a letter (it becomes a Prefect tag on each run); choose one such"
            f" as {'vision' if what == 'team' else 'alice'!r}."
        )
    if name in RESERVED:
        raise InvalidSpec(
            f"{what} name {name!r} is the platform's own; choose another name for the {what}."
        )
    return name


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidSpec(
            f"role {role!r} does not exist; choose one of {', '.join(ROLES)} (--role)."
        )
    return role


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UserBook:
    """The users file: read again whenever it changes (its size, time or inode), written
    whole under a lock by the admin's commands."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._users: dict[str, User] = {}

    def users(self) -> dict[str, User]:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            self._seen, self._users = None, {}
            return self._users
        seen = (info.st_ino, info.st_size, info.st_mtime_ns)
        if seen != self._seen:
            self._users, self._seen = self._read(), seen
        return self._users

    def _read(self) -> dict[str, User]:
        try:
            found = json.loads(read_private(self.path))
        except (FileNotFoundError, ValueError):
            return {}
        return {
            entry["name"]: User(**entry)
            for entry in (found.get("users") or [] if isinstance(found, dict) else [])
        }

    def who(self, name: str, token: str) -> User:
        """Return the user `NAME:TOKEN` names; Refused (401, one sentence) for an unknown
        name or a wrong token (alike: a stranger learns no names), or a revoked token."""
        user = self.users().get(name)
        digest = _digest(token)
        if user is None or not hmac.compare_digest(user.digest, digest):
            raise Refused(
                401,
                f"unknown user or wrong token for {name!r}; an admin makes tokens with"
                " `gpuflow platform user add`.",
            )
        if user.revoked is not None:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(user.revoked))
            raise Refused(
                401,
                f"{name}'s token was revoked on {when}; ask an admin for a new one.",
            )
        return user

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, User]]:
        make_dirs(self.path.parent, private=True)
        lock = self.path.with_name(self.path.name + ".lock")
        descriptor = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            self._seen = None
            users = dict(self.users())
            yield users
            text = json.dumps({"users": [asdict(u) for u in users.values()]}, indent=1)
            write_atomic(self.path, text + "\n")
        finally:
            os.close(descriptor)

    def add(
        self,
        name: str,
        role: str,
        kind: str = "person",
        renew: bool = False,
        team: str | None = None,
    ) -> str:
        """Make user `name` with `role` and return its auth string `NAME:TOKEN` (shown
        once: only its digest is kept). An existing user is refused unless `renew`, which
        gives it a new token (the old one stops working) and the role."""
        check_name(name)
        check_role(role)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._changing() as users:
            if name in users and not renew:
                raise InvalidSpec(
                    f"user {name!r} exists; `gpuflow platform user add {name} --renew` gives"
                    " it a new token, `gpuflow platform user revoke` ends it."
                )
            kept = users[name].team if name in users else None
            team = check_name(team, "team") if team else kept
            users[name] = User(name, role, kind, _digest(token), time.time(), team=team)
        return f"{name}:{token}"

    def revoke(self, name: str) -> User:
        """Revoke `name`'s token from the next request on; InvalidSpec when no such user."""
        with self._changing() as users:
            if name not in users:
                raise InvalidSpec(
                    f"there is no user {name!r} on this platform (`gpuflow platform user ls`)."
                )
            users[name] = replace(users[name], revoked=users[name].revoked or time.time())
            return users[name]
