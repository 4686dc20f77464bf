"""The platform's roles as pure rules: which role each of Prefect's routes takes (every route
of the installed Prefect, so an upgrade's new route is an admin's until it is placed), the
audit events' names, the user book and its bad input."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform import access
from gpuflow.tasks.platform.access import audit_name, credentials, principal, rule_for
from gpuflow.tasks.platform.users import Refused, UserBook, owner_of

ID = "9b6ff5ab-7a0b-4a66-bb1c-6e2f0a2fbd7e"


@pytest.fixture(scope="module")
def prefect_routes() -> list[tuple[str, str]]:
    """Every (method, path) of Prefect's REST API as installed."""
    from prefect.server.api.server import create_api_app

    spec = create_api_app(ignore_cache=True).openapi()
    return [(m.upper(), "/api" + p) for p, ops in spec["paths"].items() for m in ops]


def role_of(method: str, path: str) -> str:
    rule = rule_for(method, path)
    return rule.role if rule else "admin"


def test_a_viewer_reaches_no_route_that_changes_anything(prefect_routes):
    writes = [(m, p) for m, p in prefect_routes if m not in ("GET", "HEAD")]
    assert len(writes) > 100  # Prefect's API, read from the installed package
    for method, path in writes:
        if role_of(method, path) == "viewer":
            last = path.rstrip("/").rsplit("/", 1)[-1]
            searches = ("filter", "count", "paginate", "history", "lateness", "validate")
            assert (
                last in searches
                or "/ui/" in path
                or path.endswith(
                    ("concurrency_status", "count-by/{countable}", "counts", "next-runs")
                )
            ), (method, path)


def test_a_member_reaches_exactly_its_runs_routes(prefect_routes):
    member = sorted(
        f"{m} {p}"
        for m, p in prefect_routes
        if m not in ("GET", "HEAD") and role_of(m, p) == "member"
    )
    assert member == sorted(
        [
            "POST /api/flow_runs/",
            "POST /api/deployments/{id}/create_flow_run",
            "POST /api/deployments/{id}/create_flow_run/bulk",
            "POST /api/flow_runs/{id}/set_state",
            "POST /api/flow_runs/{id}/resume",
            "POST /api/flow_runs/{id}/input",
            "DELETE /api/flow_runs/{id}/input/{key}",
            "PATCH /api/flow_runs/{id}",
            "PATCH /api/flow_runs/{id}/labels",
            "DELETE /api/flow_runs/{id}",
            "POST /api/flow_runs/bulk_set_state",
            "POST /api/flow_runs/bulk_delete",
            "POST /api/task_runs/",
            "POST /api/task_runs/{id}/set_state",
            "PATCH /api/task_runs/{id}",
            "DELETE /api/task_runs/{id}",
            "POST /api/logs/",
            "POST /api/artifacts/",
            "PATCH /api/artifacts/{id}",
            "DELETE /api/artifacts/{id}",
            "POST /api/events",
            "POST /api/flows/",
            "POST /api/concurrency_limits/increment",
            "POST /api/concurrency_limits/decrement",
            "POST /api/v2/concurrency_limits/increment",
            "POST /api/v2/concurrency_limits/decrement",
            "POST /api/v2/concurrency_limits/increment-with-lease",
            "POST /api/v2/concurrency_limits/decrement-with-lease",
            "POST /api/v2/concurrency_limits/leases/{lease_id}/renew",
            "PUT /api/saved_searches/",
            "DELETE /api/saved_searches/{id}",
        ]
    )
    # every member route but the flow's record, slots and saved filters checks ownership
    for entry in member:
        method, path = entry.split(" ")
        rule = rule_for(method, path)
        assert rule is not None
        mundane = ("/flows/", "concurrency_limits", "saved_searches")
        assert rule.check or any(part in path for part in mundane), entry


@pytest.mark.parametrize(
    ("method", "path", "role"),
    [
        ("GET", "/api/admin/settings", "admin"),
        ("PUT", "/api/admin/storage", "admin"),
        ("GET", "/api/flow_runs/5f0e", "viewer"),
        ("POST", "/api/work_pools/gpu/get_scheduled_flow_runs", "admin"),
        ("POST", "/api/work_pools/gpu/workers/heartbeat", "admin"),
        ("PATCH", "/api/deployments/5f0e", "admin"),
        ("POST", "/api/block_documents/", "admin"),
        ("POST", "/api/block_documents/filter", "viewer"),
        ("POST", "/api//flow_runs/filter", "admin"),  # what Prefect would not route either
        ("POST", "/api/flow_runs/filter/../set_state", "admin"),
    ],
)
def test_routes_take_their_roles(method, path, role):
    assert role_of(method, path) == role


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("POST", "/api/flow_runs/", "gpuflow.audit.flow-run.created"),
        (
            "POST",
            "/api/flow_runs/{ID}/set_state",
            "gpuflow.audit.flow-run.set-state",
        ),
        (
            "DELETE",
            "/api/deployments/{ID}",
            "gpuflow.audit.deployment.deleted",
        ),
        (
            "POST",
            "/api/deployments/{ID}/create_flow_run",
            "gpuflow.audit.deployment.create-flow-run",
        ),
        ("PATCH", "/api/v2/concurrency_limits/gpu", "gpuflow.audit.concurrency-limit.changed"),
        ("POST", "/api/flow_runs/bulk_delete", "gpuflow.audit.flow-run.bulk-delete"),
        ("PUT", "/api/saved_searches/", "gpuflow.audit.saved-search.put"),
    ],
)
def test_audit_events_are_named_after_the_object_and_the_action(method, path, name):
    assert audit_name(method, path) == name


def test_the_user_book_keeps_digests_only_and_is_this_users_alone(tmp_path):
    book = UserBook(tmp_path / "platform" / "users.json")
    auth = book.add("alice", "member")
    name, token = auth.split(":", 1)
    assert name == "alice" and token.startswith("gfu_") and len(token) > 40
    text = (tmp_path / "platform" / "users.json").read_text()
    assert token not in text and "alice" in text
    assert stat.S_IMODE(os.stat(tmp_path / "platform" / "users.json").st_mode) == 0o600
    assert book.who("alice", token).role == "member"
    platform = "gpuflow:platform-string"
    assert principal(platform, platform, book).platform
    assert principal(auth, platform, book).name == "alice"
    book.revoke("alice")
    with pytest.raises(Refused, match="alice's token was revoked on "):
        UserBook(book.path).who("alice", token)  # another process reads the change


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda b: b.add("Alice", "member"), "user name 'Alice' is not 1-63 lower-case"),
        (lambda b: b.add("al ice", "member"), "user name 'al ice' is not"),
        (lambda b: b.add("a" * 64, "member"), "is not 1-63 lower-case"),
        (lambda b: b.add("owner", "member"), "is the platform's own"),
        (lambda b: b.add("gpuflow", "admin"), "is the platform's own"),
        (lambda b: b.add("bob", "superuser"), "role 'superuser' does not exist; choose one of"),
        (lambda b: b.revoke("nobody"), "there is no user 'nobody' on this platform"),
    ],
)
def test_bad_users_and_roles_are_one_sentence(tmp_path, call, said):
    book = UserBook(tmp_path / "users.json")
    with pytest.raises(InvalidSpec, match=said):
        call(book)
    assert not (tmp_path / "users.json").exists() or "bob" not in book.users()


def test_adding_a_user_twice_is_refused_and_renewing_ends_the_old_token(tmp_path):
    book = UserBook(tmp_path / "users.json")
    first = book.add("ci", "member", "service").split(":", 1)[1]
    with pytest.raises(InvalidSpec, match="user 'ci' exists; `gpuflow platform user add ci"):
        book.add("ci", "member")
    second = book.add("ci", "viewer", "service", renew=True).split(":", 1)[1]
    with pytest.raises(Refused, match="unknown user or wrong token for 'ci'"):
        book.who("ci", first)
    assert book.who("ci", second).role == "viewer"


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (b"Bearer x", "is not `Basic`"),
        (b"Basic ***", "is not `Basic`"),
        (b"Basic " + base64.b64encode(b"\xff\xfe"), "is not `Basic`"),
    ],
)
def test_a_malformed_authorization_is_one_sentence(header, said):
    with pytest.raises(Refused, match=said) as refused:
        credentials({b"authorization": header})
    assert refused.value.status == 401


def test_a_runs_owner_is_read_from_its_tags():
    assert owner_of(["sweep", "owner:alice"]) == "alice"
    assert owner_of(["sweep"]) is None and owner_of(None) is None
    assert access.owner_tag("bob") == "owner:bob"


def _spec(**extra):
    from gpuflow.tasks.spec import load_spec

    base = {"name": "j", "job": {"kind": "command", "command": ["echo", "hi"]}}
    return load_spec({**base, **extra})


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({}, "image: mia is a member of this shared platform, and a member's job on the"),
        (
            {
                "image": "python:3.12-slim",
                "job": {"kind": "command", "command": ["echo"], "workdir": "/root"},
            },
            "job.workdir: mia is a member of this shared platform, and its run may not send",
        ),
        (
            {"image": "python:3.12-slim", "storage": {"artifacts": "file:///root/.gpuflow"}},
            "storage.artifacts: mia is a member of this shared platform, and its run may not",
        ),
        (
            {
                "image": "blender:4",
                "job": {"kind": "render", "scene": "/etc/hostname", "output": "s3://b/o"},
            },
            "job.scene: mia is a member of this shared platform, and its run may not read",
        ),
        (
            {
                "image": "python:3.12-slim",
                "placement": {"backend": "local", "workspace_root": "/tmp"},
            },
            "placement.workspace_root: mia is a member of this shared platform, and its run",
        ),
        (
            {"image": "python:3.12-slim", "secret_env": {"T": "registry-key"}},
            "secret_env.T: Secret block 'registry-key' is not mia's; a member's run reads only",
        ),
    ],
)
def test_a_members_run_asks_for_no_power_of_the_platforms_owner(tmp_path, extra, said):
    from gpuflow.tasks.platform.confine import confine

    book = UserBook(tmp_path / "users.json")
    book.add("mia", "member")
    with pytest.raises(InvalidSpec, match=said.replace(".", r"\.")):
        confine(_spec(**extra), ["owner:mia"], book)


def test_the_platforms_runs_an_admins_and_a_members_confined_run_pass(tmp_path):
    from gpuflow.tasks.platform.confine import confine

    book = UserBook(tmp_path / "users.json")
    book.add("mia", "member")
    book.add("ada", "admin")
    free = _spec(storage={"artifacts": "file:///srv/runs"})
    confine(free, [], book)  # the platform's own
    confine(free, ["owner:ada"], book)
    confine(free, ["owner:mia"], UserBook(tmp_path / "elsewhere.json"))  # not the platform
    confine(_spec(image="python:3.12-slim", secret_env={"T": "mia-token"}), ["owner:mia"], book)
    book.revoke("mia")
    with pytest.raises(InvalidSpec, match="belongs to mia, who is no longer a user"):
        confine(free, ["owner:mia"], book)
