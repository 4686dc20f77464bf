"""Who may do what on a shared platform: the front every request crosses before Prefect's
server (ASGI middleware, after the Host check).

A request sends Prefect's basic auth. The platform's own string (its owner's commands, its
worker, the runs it starts) passes as before. `NAME:TOKEN` of a user in the user book
(tasks/platform/users.py) passes with that user's role: the route must be one the role
may reach (ROUTES, read top to bottom; a route not there is an admin's), and what it
changes must be the user's own. The request then goes on with the platform's string, so
Prefect's own check stays as it is. Anything else is refused here: 401 (who are you) or
403 (not yours), one sentence each, before Prefect reads the request.

- Owners: a flow run made by a user carries the tag `owner:NAME` (added here; a tag of that
  form the user sent is dropped), a subflow its parent's. A member may change, cancel,
  retry or delete only runs with its own tag, and their task runs, logs and artifacts; a
  bulk change is narrowed to the member's runs.
- Secrets: a block document read "with secrets" by a non-admin is read without them; one
  whose type has secret fields is then refused (403): a member's flow that loads a Secret
  gets a sentence, never "********" for a value.
- Audit: every change a user makes (and every delete or cancel with the platform's own
  string) is a Prefect event `gpuflow.audit.<object>.<action>` about the resource
  `gpuflow.user.NAME`, the object it changed related, with the HTTP status.
- Websockets authenticate with their first message (`{"type": "auth", "token": ...}`),
  which is checked and rewritten the same way; a member's event named `gpuflow.audit.*`
  is refused.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode
from uuid import UUID, uuid4

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform import admission
from gpuflow.tasks.platform.users import (
    OWNER_TAG,
    Refused,
    UserBook,
    at_least,
    owner_of,
    owner_tag,
)

AUDIT = "gpuflow.audit."
QUOTAS = "/api/gpuflow/quotas"  # gpuflow's own route on the platform: quotas and caps
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class Principal:
    """Who sends a request: a user of the book, or the platform itself (`name` "owner")."""

    name: str
    role: str
    platform: bool = False


OWNER = Principal("owner", "admin", platform=True)


@dataclass(frozen=True)
class Rule:
    method: str
    pattern: re.Pattern[str]
    role: str
    check: str | None = None  # how the target is the caller's own (see Front._check)


def _rule(method: str, template: str, role: str, check: str | None = None) -> Rule:
    regex = re.escape(template.rstrip("/")).replace(r"\{rest\}", ".+")
    regex = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", regex)  # {id}: one part of the path
    return Rule(method, re.compile(f"/api{regex}"), role, check)


READ_SUFFIXES = ("filter", "count", "paginate", "history", "count-by/{countable}")
ROUTES: list[Rule] = [
    # Prefect's own settings and storage: admins only (before the GET rule).
    _rule("*", "/admin/{rest}", "admin"),
    _rule("GET", "/admin", "admin"),
    _rule("GET", "/block_documents/{id}", "viewer", "secrets"),
    _rule("GET", "/block_types/slug/{slug}/block_documents", "viewer", "secrets"),
    _rule("GET", "/block_types/slug/{slug}/block_documents/name/{name}", "viewer", "secrets"),
    _rule("POST", "/block_documents/filter", "viewer", "secrets"),
    # Reads a worker makes are also its claims on runs: the platform's and admins'.
    _rule("POST", "/work_pools/{name}/get_scheduled_flow_runs", "admin"),
    _rule("POST", "/work_queues/{id}/get_runs", "admin"),
    _rule("POST", "/deployments/get_scheduled_flow_runs", "admin"),
    # Reads: every GET, the POST searches and the UI's summaries.
    *[
        rule
        for suffix in READ_SUFFIXES
        for rule in (
            _rule("POST", f"/{{a}}/{suffix}", "viewer"),
            _rule("POST", f"/{{a}}/{{b}}/{suffix}", "viewer"),
            _rule("POST", f"/{{a}}/{{b}}/{{c}}/{suffix}", "viewer"),
        )
    ],
    _rule("POST", "/ui/{a}/{b}", "viewer"),
    _rule("POST", "/ui/{a}/{b}/{c}", "viewer"),
    _rule("POST", "/flow_runs/lateness", "viewer"),
    _rule("POST", "/templates/validate", "viewer"),
    _rule("POST", "/automations/templates/validate", "viewer"),
    _rule("POST", "/work_pools/{name}/concurrency_status", "viewer"),
    _rule("POST", "/work_queues/{id}/concurrency_status", "viewer"),
    _rule("GET", "/{rest}", "viewer"),
    _rule("HEAD", "/{rest}", "viewer"),
    # A member's runs: made (tagged with the maker), changed and ended by their owner.
    _rule("POST", "/flow_runs", "member", "create_run"),
    _rule("POST", "/deployments/{id}/create_flow_run", "member", "create_run"),
    _rule("POST", "/deployments/{id}/create_flow_run/bulk", "member", "create_runs"),
    _rule("POST", "/flow_runs/{id}/set_state", "member", "flow_run"),
    _rule("POST", "/flow_runs/{id}/resume", "member", "flow_run"),
    _rule("POST", "/flow_runs/{id}/input", "member", "flow_run"),
    _rule("DELETE", "/flow_runs/{id}/input/{key}", "member", "flow_run"),
    _rule("PATCH", "/flow_runs/{id}", "member", "flow_run"),
    _rule("PATCH", "/flow_runs/{id}/labels", "member", "flow_run"),
    _rule("DELETE", "/flow_runs/{id}", "member", "flow_run"),
    _rule("POST", "/flow_runs/bulk_set_state", "member", "bulk"),
    _rule("POST", "/flow_runs/bulk_delete", "member", "bulk"),
    _rule("POST", "/task_runs", "member", "body_flow_run"),
    _rule("POST", "/task_runs/{id}/set_state", "member", "task_run"),
    _rule("PATCH", "/task_runs/{id}", "member", "task_run"),
    _rule("DELETE", "/task_runs/{id}", "member", "task_run"),
    _rule("POST", "/logs", "member", "logs"),
    _rule("POST", "/artifacts", "member", "body_flow_run"),
    _rule("PATCH", "/artifacts/{id}", "member", "artifact"),
    _rule("DELETE", "/artifacts/{id}", "member", "artifact"),
    _rule("POST", "/events", "member", "events"),
    # What a member's own flow needs on the way: its flow's record, its slots.
    _rule("POST", "/flows", "member"),
    _rule("POST", "/concurrency_limits/increment", "member"),
    _rule("POST", "/concurrency_limits/decrement", "member"),
    _rule("POST", "/v2/concurrency_limits/increment", "member"),
    _rule("POST", "/v2/concurrency_limits/decrement", "member"),
    _rule("POST", "/v2/concurrency_limits/increment-with-lease", "member"),
    _rule("POST", "/v2/concurrency_limits/decrement-with-lease", "member"),
    _rule("POST", "/v2/concurrency_limits/leases/{id}/renew", "member"),
    # The UI's saved filters.
    _rule("PUT", "/saved_searches", "member"),
    _rule("DELETE", "/saved_searches/{id}", "member"),
]
SOCKETS = {  # the websockets, by path, and the least role each takes
    "/api/events/out": "viewer",
    "/api/logs/out": "viewer",
    "/api/events/in": "member",
}
AUDITED_QUIET = ("/api/logs", "/api/events", "/api/task_runs", "/api/concurrency_limits")


def rule_for(method: str, path: str) -> Rule | None:
    """Return the first rule for `method path` (None: an admin's route)."""
    path = path.rstrip("/") or "/"
    for rule in ROUTES:
        if rule.method in (method, "*") and rule.pattern.fullmatch(path):
            return rule
    return None


def audit_name(method: str, path: str) -> str:
    """Return the audit event a change is recorded as: `gpuflow.audit.flow-run.set-state`
    for POST /api/flow_runs/ID/set_state, `...deployment.deleted` for a DELETE."""
    parts = [p for p in path.removeprefix("/api/").strip("/").split("/") if p]
    parts = parts[1:] if parts[:1] == ["v2"] else parts
    thing, rest = (parts[0] if parts else "api"), parts[1:]
    verb = {"POST": "created", "PUT": "put", "PATCH": "changed", "DELETE": "deleted"}
    if method == "POST" and len(rest) == 1 and not _is_id(rest[0]):
        action = rest[0]  # flow_runs/bulk_delete
    elif len(rest) >= 2 and [p for p in rest[1:] if not _is_id(p)]:
        action = [p for p in rest[1:] if not _is_id(p)][-1]  # flow_runs/ID/set_state
    else:  # the object itself, by id or name
        action = verb.get(method, method.lower())
    singular = thing[:-2] if thing.endswith(("ches", "shes")) else thing.rstrip("s")
    return f"{AUDIT}{singular.replace('_', '-')}.{action.replace('_', '-')}"


def _is_id(part: str) -> bool:
    try:
        UUID(part)
        return True
    except ValueError:
        return False


def _first_id(path: str) -> str | None:
    return next((p for p in path.split("/") if _is_id(p)), None)


def credentials(headers: dict[bytes, bytes]) -> str | None:
    """Return the auth string a request's Basic Authorization carries (None: none sent);
    Refused (401) when the header is there but is not Basic base64(NAME:TOKEN)."""
    value = headers.get(b"authorization")
    if value is None:
        return None
    scheme, _, encoded = value.decode("latin-1").strip().partition(" ")
    try:
        if scheme.lower() != "basic":
            raise ValueError
        return base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Refused(
            401,
            "the Authorization header is not `Basic` and base64 of NAME:TOKEN; send your"
            " token as PREFECT_API_AUTH_STRING (or the UI's login) as it was given to you.",
        ) from None


def principal(auth: str, platform_auth: str, book: UserBook) -> Principal:
    """Return who `auth` (a sent auth string) is: the platform, or a user of the book."""
    if hmac.compare_digest(auth.encode(), platform_auth.encode()):
        return OWNER
    name, colon, token = auth.partition(":")
    if not colon or not token:
        raise Refused(
            401,
            "the auth string is not NAME:TOKEN; send your token as PREFECT_API_AUTH_STRING"
            " (or the UI's login) as `gpuflow platform user add` printed it.",
        )
    user = book.who(name, token)
    return Principal(user.name, user.role)


class Denied(Refused):
    def __init__(self, sentence: str) -> None:
        super().__init__(403, sentence)


def _not_allowed(who: Principal, method: str, path: str, wanted: str) -> Denied:
    can = {"viewer": "read", "member": "read, and make and change its own runs"}
    return Denied(
        f"{who.name} is a {who.role} (may {can.get(who.role, 'do everything')}):"
        f" {method} {path} takes a{'n' if wanted == 'admin' else ''} {wanted}; ask an admin."
    )


class Front:
    """The ASGI middleware: authenticate, authorise, narrow, record."""

    def __init__(self, app: Any, platform_auth: str, book: UserBook) -> None:
        self.app, self.platform_auth, self.book = app, platform_auth, book
        self._basic = [(b"authorization", b"Basic " + base64.b64encode(platform_auth.encode()))]

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "websocket" and path.startswith("/api/"):
            await self._socket(scope, receive, send)
            return
        if scope["type"] != "http" or not path.startswith("/api/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        try:
            sent = credentials(headers)
            if sent is None:  # Prefect answers: 401, or its health and docs pages
                await self.app(scope, receive, send)
                return
            who = principal(sent, self.platform_auth, self.book)
        except Refused as exc:
            await _answer(send, exc.status, exc.sentence)
            return
        if path.rstrip("/").startswith(QUOTAS):  # gpuflow's own route: answered here
            await self._quotas(scope, receive, send, who)
            return
        if who.platform:
            body = None
            if scope["method"] == "POST" and path.endswith("/set_state"):  # a cancel: audited
                body = await _read_body(receive)
                receive = _replay(body, receive)
            await self._pass(scope, receive, send, who, body)
            return
        try:
            body, scope = await self._authorise(scope, receive, who)
        except Refused as exc:
            await _answer(send, exc.status, exc.sentence)
            return
        await self._pass(scope, _replay(body, receive), send, who, body)

    async def _quotas(self, scope: dict, receive: Receive, send: Send, who: Principal) -> None:
        """GET /api/gpuflow/quotas (any user): the quotas, caps and who holds or waits;
        PUT (an admin): {"team", "gpus", "scope"} sets a team's quota, {"user", "gpus"} a
        user's cap (gpus null removes it). Recorded as audit events."""
        method, path = scope["method"], scope["path"]
        folder = self.book.path.parent
        if method == "GET":
            quotas = admission.read_quotas(folder, self.book)
            rows = admission.Ledger(folder).read()
            summary = [
                {
                    k: r.get(k)
                    for k in ("run", "user", "team", "gpus", "scope", "state", "position", "reason")
                }
                for r in rows
            ]
            await _answer_json(
                send, 200, {"teams": quotas.teams, "caps": quotas.caps, "entries": summary}
            )
            return
        if method != "PUT" or not at_least(who.role, "admin"):
            await _answer(send, 403, _not_allowed(who, method, path, "admin").sentence)
            return
        data = _json(await _read_body(receive))
        try:
            if not isinstance(data, dict):
                raise InvalidSpec('the body is not {"team", "gpus", "scope"} or {"user", "gpus"}')
            gpus: Any = data.get("gpus")
            if "user" in data:
                admission.set_cap(folder, str(data["user"]), None if gpus is None else int(gpus))
            else:
                admission.set_quota(
                    folder, str(data.get("team")), int(gpus), str(data.get("scope") or "*")
                )
        except (InvalidSpec, ValueError, TypeError) as exc:
            await _answer(send, 422, str(exc))
            return
        await _answer_json(send, 200, {"done": True})
        await _record(who, "PUT", path, 200, json.dumps(data).encode(), b"{}")

    async def _authorise(self, scope: dict, receive: Receive, who: Principal) -> tuple[bytes, dict]:
        method, path = scope["method"], scope["path"]
        rule = rule_for(method, path)
        wanted = rule.role if rule else "admin"
        if not at_least(who.role, wanted):
            raise _not_allowed(who, method, path, wanted)
        body = await _read_body(receive)
        headers = [
            (k, v)
            for k, v in scope.get("headers") or []
            if k not in (b"authorization", b"content-length", b"prefect-automation-id")
        ] + self._basic
        scope = dict(scope, headers=headers)
        if rule is not None and rule.check in ("create_run", "create_runs"):
            body = await self._check(rule.check, who, path, body)  # every user's: its tag
        elif rule is not None and rule.check and who.role != "admin":
            body = await self._check(rule.check, who, path, body)
        scope["headers"] = scope["headers"] + [(b"content-length", str(len(body)).encode())]
        return body, scope

    async def _check(self, check: str, who: Principal, path: str, body: bytes) -> bytes:
        """Make sure what the request touches is `who`'s; return the body, narrowed where
        it can be (the owner's tag added, a bulk change confined to `who`'s runs)."""
        data = _json(body)
        if check in ("create_run", "create_runs"):
            runs = data if isinstance(data, list) else [data if isinstance(data, dict) else {}]
            for run in runs:
                if who.role != "admin":
                    await _own_parent(who, run)
                _tag_owner(run, who)
            return json.dumps(runs if check == "create_runs" else runs[0]).encode()
        if check == "flow_run":
            await _own_run(who, _first_id(path))
            if isinstance(data, dict) and "tags" in data:  # a PATCH keeps the owner's tag
                return json.dumps(_tag_owner(data, who)).encode()
        elif check in ("task_run", "artifact"):
            await _own_run(who, await _run_of(check, _first_id(path)))
        elif check == "body_flow_run":
            await _own_run(who, data.get("flow_run_id") if isinstance(data, dict) else None)
        elif check == "logs":
            logs = data if isinstance(data, list) else [None]
            for run in {log.get("flow_run_id") if isinstance(log, dict) else None for log in logs}:
                await _own_run(who, run)
        elif check == "bulk":
            return json.dumps(_only_owned(data, who)).encode()
        elif check == "events":
            _no_audit_events(who, data if isinstance(data, list) else [data])
        return body

    async def _pass(
        self, scope: dict, receive: Receive, send: Send, who: Principal, body: bytes | None
    ) -> None:
        """Hand the request to Prefect; a block read without secrets that has secret fields
        is answered 403; a change is recorded."""
        method, path = scope["method"], scope["path"]
        narrowed = not who.platform and who.role != "admin" and _reads_secrets(scope, body)
        if narrowed:
            scope, body = _without_secrets(scope, body or b"")
            receive = _replay(body, receive)
        audited = _audited(who, method, path, body)
        if not narrowed and not audited:
            await self.app(scope, receive, send)
            return
        status: list[int] = []
        chunks: list[bytes] = []
        held: list[dict] = []

        async def keep(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                held.append(message)
                return
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    await _release(send, held, b"".join(chunks), who, narrowed)
                return
            await send(message)

        await self.app(scope, receive, keep)
        if audited and status:
            _later(_record(who, method, path, status[0], body, b"".join(chunks)))

    async def _socket(self, scope: dict, receive: Receive, send: Send) -> None:
        """A websocket: its first message authenticates; a member's events are checked."""
        path = scope["path"].rstrip("/")
        state: dict[str, Any] = {"who": None, "closed": False}

        async def checked() -> dict:
            message = await receive()
            if message["type"] != "websocket.receive" or state["closed"]:
                return message
            text = message.get("text") or (message.get("bytes") or b"").decode("utf-8", "replace")
            try:
                data = json.loads(text)
            except ValueError:
                return message
            try:
                if state["who"] is None and isinstance(data, dict) and data.get("type") == "auth":
                    who = principal(str(data.get("token") or ""), self.platform_auth, self.book)
                    wanted = SOCKETS.get(path, "admin")
                    if not at_least(who.role, wanted):
                        raise _not_allowed(who, "websocket", path, wanted)
                    state["who"] = who
                    return dict(
                        message, text=json.dumps(dict(data, token=self.platform_auth)), bytes=None
                    )
                who = state["who"]
                if (
                    who is not None
                    and not who.platform
                    and who.role != "admin"
                    and path == "/api/events/in"
                ):
                    _no_audit_events(who, data if isinstance(data, list) else [data])
            except Refused as exc:
                state["closed"] = True
                await send({"type": "websocket.close", "code": 1008, "reason": exc.sentence[:120]})
                return {"type": "websocket.disconnect", "code": 1008}
            return message

        async def guarded(message: dict) -> None:
            if not state["closed"]:
                await send(message)

        await self.app(scope, checked, guarded)


def _json(body: bytes | None) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None  # Prefect answers it (422)


def _tag_owner(run: dict, who: Principal) -> dict:
    """Give a run's body the tag naming `who` as its owner (and no other owner tag)."""
    tags: list = run["tags"] if isinstance(run.get("tags"), list) else []
    run["tags"] = [t for t in tags if not str(t).startswith(OWNER_TAG)] + [owner_tag(who.name)]
    return run


def _only_owned(data: Any, who: Principal) -> dict:
    """Narrow a bulk change's flow-run filter to the runs tagged with `who`."""
    data = data if isinstance(data, dict) else {}
    runs: dict = data["flow_runs"] if isinstance(data.get("flow_runs"), dict) else {}
    tags: dict = runs["tags"] if isinstance(runs.get("tags"), dict) else {}
    tags["all_"] = [*(tags.get("all_") or []), owner_tag(who.name)]
    runs["tags"], data["flow_runs"] = tags, runs
    return data


def _no_audit_events(who: Principal, events: list[Any]) -> None:
    for event in events:
        name = str((event or {}).get("event", "")) if isinstance(event, dict) else ""
        if name.startswith(AUDIT):
            raise Denied(
                f"{who.name} may not emit {name}: gpuflow.audit.* events are the platform's."
            )


def _reads_secrets(scope: dict, body: bytes | None) -> bool:
    rule = rule_for(scope["method"], scope["path"])
    if rule is None or rule.check != "secrets":
        return False
    if scope["method"] == "GET":
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        return query.get("include_secrets", "").lower() in ("true", "1", "yes", "on")
    try:
        return bool((json.loads(body or b"{}") or {}).get("include_secrets"))
    except (ValueError, AttributeError):
        return False


def _without_secrets(scope: dict, body: bytes) -> tuple[dict, bytes]:
    """Return the request with include_secrets false (query or body), uncompressed."""
    headers = [
        (k, v) for k, v in scope["headers"] if k not in (b"accept-encoding", b"content-length")
    ]
    if scope["method"] == "GET":
        query = [
            (k, "false" if k == "include_secrets" else v)
            for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        ]
        scope = dict(scope, query_string=urlencode(query).encode())
    else:
        data = json.loads(body or b"{}")
        data["include_secrets"] = False
        body = json.dumps(data).encode()
    headers.append((b"content-length", str(len(body)).encode()))
    return dict(scope, headers=headers), body


async def _release(
    send: Send, held: list[dict], body: bytes, who: Principal, narrowed: bool
) -> None:
    """Send a held answer on; a single block document with secret fields read by a
    non-admin is refused instead."""
    if narrowed and held and held[0]["status"] == 200:
        try:
            found = json.loads(body)
        except ValueError:
            found = None
        if isinstance(found, dict) and ((found.get("block_schema") or {}).get("fields") or {}).get(
            "secret_fields"
        ):
            name = found.get("name") or found.get("id")
            await _answer(
                send,
                403,
                f"block {name!r} holds secret values, which only admins and the platform's"
                f" runs read; {who.name} is a {who.role}.",
            )
            return
    start = dict(held[0])
    start["headers"] = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"] + [
        (b"content-length", str(len(body)).encode())
    ]
    await send(start)
    await send({"type": "http.response.body", "body": body})


def _audited(who: Principal, method: str, path: str, body: bytes | None) -> bool:
    if method in ("GET", "HEAD", "OPTIONS"):
        return False
    rule = rule_for(method, path)
    if rule is not None and rule.role == "viewer":
        return False  # a search
    if who.platform:  # the platform's own: what ends runs and deletes things
        return method == "DELETE" or (path.endswith("/set_state") and _cancels(body))
    return not path.rstrip("/").startswith(AUDITED_QUIET)


def _cancels(body: bytes | None) -> bool:
    return _state_type(body) in ("CANCELLING", "CANCELLED")


def _state_type(body: bytes | None) -> str | None:
    """Return the state type a set_state body asks for (CANCELLING, SCHEDULED, ...)."""
    try:
        state = (json.loads(body or b"{}") or {}).get("state") or {}
        return str(state.get("type")) if isinstance(state, dict) and state.get("type") else None
    except (ValueError, AttributeError):
        return None


_PENDING: set[asyncio.Task] = set()


def _later(recording: Any) -> None:
    """Record off the request's path: its answer is sent, the event follows."""
    task = asyncio.get_running_loop().create_task(recording)
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


async def _record(
    who: Principal, method: str, path: str, status: int, body: bytes | None, answer: bytes
) -> None:
    """Emit the audit event of one change."""
    from prefect.server.events.clients import PrefectServerEventsClient
    from prefect.server.events.schemas.events import Event
    from prefect.types._datetime import now

    target = _first_id(path)
    if target is None:
        try:
            target = str((json.loads(answer) or {}).get("id") or "") or None
        except (ValueError, AttributeError):
            target = None
    payload: dict[str, Any] = {"method": method, "path": path, "status": status}
    if path.endswith("/set_state"):
        payload["state"] = _state_type(body)
    thing = audit_name(method, path).removeprefix(AUDIT).split(".")[0]
    related = (
        [{"prefect.resource.id": f"prefect.{thing}.{target}", "prefect.resource.role": "target"}]
        if target
        else []
    )
    event = Event(
        id=uuid4(),
        occurred=now("UTC"),
        event=audit_name(method, path),
        resource={
            "prefect.resource.id": f"gpuflow.user.{who.name}",
            "prefect.resource.name": who.name,
            "gpuflow.role": who.role,
        },
        related=related,
        payload=payload,
    )
    async with PrefectServerEventsClient() as events:
        await events.emit(event)


async def _own_parent(who: Principal, run: dict) -> None:
    parent = run.get("parent_task_run_id")
    if parent:
        await _own_run(who, await _run_of("task_run", str(parent)))


async def _own_run(who: Principal, run_id: str | None) -> None:
    """Denied unless flow run `run_id` carries `who`'s owner tag."""
    tags = await _run_tags(run_id) if run_id else None
    if tags is None:
        raise Denied(f"{who.name} may change only its own flow runs; this names none of them.")
    owner = owner_of(tags)
    if owner != who.name:
        whose = f"{owner}'s" if owner else "the platform's"
        raise Denied(
            f"flow run {run_id} is {whose}; {who.name} (a {who.role}) may change only its own runs."
        )


async def _run_tags(run_id: str) -> list[str] | None:
    from prefect.server import models
    from prefect.server.database import provide_database_interface

    try:
        key = UUID(str(run_id))
    except ValueError:
        return None
    async with provide_database_interface().session_context() as session:
        read: Any = models.flow_runs.read_flow_run
        run = await read(session=session, flow_run_id=key)
    return list(run.tags) if run is not None else None


async def _run_of(kind: str, object_id: str | None) -> str | None:
    """Return the flow run a task run or an artifact belongs to."""
    from prefect.server import models
    from prefect.server.database import provide_database_interface

    try:
        key = UUID(str(object_id))
    except ValueError:
        return None
    async with provide_database_interface().session_context() as session:
        if kind == "task_run":
            read: Any = models.task_runs.read_task_run
            found = await read(session=session, task_run_id=key)
        else:
            read = models.artifacts.read_artifact
            found = await read(session=session, artifact_id=key)
    run = getattr(found, "flow_run_id", None) if found is not None else None
    return str(run) if run else None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, then: Receive) -> Receive:
    """Return a receive that gives `body` once, then waits on the client as `then` does
    (for its disconnect)."""
    sent = [False]

    async def receive() -> dict:
        if sent[0]:
            return await then()
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _answer_json(send: Send, status: int, data: Any) -> None:
    body = json.dumps(data).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _answer(send: Send, status: int, sentence: str) -> None:
    body = json.dumps({"detail": sentence}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            + ([(b"www-authenticate", b'Basic realm="gpuflow"')] if status == 401 else []),
        }
    )
    await send({"type": "http.response.body", "body": body})
