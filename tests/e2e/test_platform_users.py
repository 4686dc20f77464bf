"""A shared platform's users and roles, against the platform's real server
(tasks/platform/server.py: Prefect's app behind the Host check and the front): an admin, two
members, a viewer and a CI service account, each with its own token. Every route a role
must not reach is refused in one sentence, on the API, on its websockets and in the UI
(headless Chromium); Secret values reach admins only; the audit trail names who cancelled a
run; a revoked token is refused on the next request."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from gpuflow.tasks.host import stop_group
from gpuflow.tasks.platform.users import UserBook
from tests.conftest import free_port
from tests.e2e.browser import CHROMIUM, chromium, tab

pytestmark = pytest.mark.e2e
USERS = {"ada": "admin", "mia": "member", "max": "member", "vic": "viewer"}


class Shared:
    """The platform's server with its user book, and each user's auth string."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.api, self.ui = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
        self.book = UserBook(root / "users.json")
        self.auth = {name: self.book.add(name, role) for name, role in USERS.items()}
        self.auth["ci"] = self.book.add("ci", "member", "service")
        self.auth["owner"] = "gpuflow:" + base64.urlsafe_b64encode(os.urandom(24)).decode()
        (root / "auth").write_text(self.auth["owner"] + "\n")
        (root / "auth").chmod(0o600)

    def ask(self, who: str, method: str, path: str, body: object = None, **params: str):
        headers = {"Authorization": basic(self.auth[who])} if who else {}
        return httpx.request(
            method, self.api + path, json=body, headers=headers, params=params, timeout=30
        )


def basic(auth: str) -> str:
    return "Basic " + base64.b64encode(auth.encode()).decode()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-platform")
    platform = Shared(root, free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(root / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_API_URL=platform.api,
    )
    argv = [sys.executable, "-m", "gpuflow.tasks.platform.server", "--ui"]
    argv += ["--port", str(platform.port), "--auth-file", str(root / "auth")]
    argv += ["--users", str(root / "users.json")]
    log = (root / "server.log").open("wb")
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(platform.api + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not answer in 240 s"
            time.sleep(0.2)
        flow = platform.ask("owner", "POST", "/flows/", {"name": "shared-flow"}).json()
        platform.flow = flow["id"]
        deployment = platform.ask(
            "owner", "POST", "/deployments/", {"name": "nightly", "flow_id": flow["id"]}
        )
        assert deployment.status_code in (200, 201), deployment.text
        platform.deployment = deployment.json()["id"]
        yield platform
    finally:
        stop_group(server.pid, None, grace_s=10)
        server.wait(timeout=30)


def run_of(shared: Shared, who: str, tags: list[str] | None = None) -> dict:
    """A run `who` makes from the deployment (as `prefect deployment run` does)."""
    made = shared.ask(
        who, "POST", f"/deployments/{shared.deployment}/create_flow_run", {"tags": tags or []}
    )
    assert made.status_code in (200, 201), made.text
    return made.json()


def test_each_run_records_its_maker_and_a_forged_owner_tag_is_dropped(shared):
    run = run_of(shared, "mia", tags=["owner:max", "sweep"])
    assert "owner:mia" in run["tags"] and "sweep" in run["tags"]
    assert "owner:max" not in run["tags"]
    made = shared.ask("ci", "POST", "/flow_runs/", {"flow_id": shared.flow, "tags": []})
    assert made.status_code == 201 and made.json()["tags"] == ["owner:ci"], made.text
    mine = shared.ask("owner", "POST", "/flow_runs/", {"flow_id": shared.flow}).json()
    assert not [t for t in mine["tags"] if t.startswith("owner:")]  # the platform's own
    # a member's run keeps its owner when the member changes its tags
    changed = shared.ask("mia", "PATCH", f"/flow_runs/{run['id']}", {"tags": ["x"]})
    assert changed.status_code == 204, changed.text
    after = shared.ask("vic", "GET", f"/flow_runs/{run['id']}")
    assert after.status_code == 200, after.text
    after = after.json()
    assert sorted(after["tags"]) == ["owner:mia", "x"]


LINE = {"name": "x", "level": 20, "message": "m", "timestamp": "2026-12-07T00:00:00Z"}


def event(name: str, about: str) -> dict:
    return {
        "event": name,
        "resource": {"prefect.resource.id": about},
        "occurred": "2026-12-07T00:00:00Z",
        "id": str(uuid.uuid4()),
    }


WRITES = [  # (method, path template, body): each refused to a viewer
    ("POST", "/deployments/{deployment}/create_flow_run", {}),
    ("POST", "/flow_runs/", {"flow_id": "{flow}"}),
    ("POST", "/flow_runs/{run}/set_state", {"state": {"type": "CANCELLING"}}),
    ("DELETE", "/flow_runs/{run}", None),
    ("POST", "/logs/", [dict(LINE, flow_run_id="{run}")]),
    ("POST", "/events", [event("gpuflow.scene.uploaded", "x")]),
]
ADMINS = [  # (method, path template, body): each refused to a member and a viewer
    ("PATCH", "/deployments/{deployment}", {"description": "mine now"}),
    ("DELETE", "/deployments/{deployment}", None),
    ("POST", "/deployments/", {"name": "other", "flow_id": "{flow}"}),
    ("POST", "/block_documents/", {"name": "b"}),
    ("POST", "/variables/", {"name": "v", "value": 1}),
    ("POST", "/work_pools/", {"name": "p"}),
    ("POST", "/automations/", {"name": "a"}),
    ("GET", "/admin/settings", None),
    ("POST", "/work_pools/default/get_scheduled_flow_runs", {}),
    ("POST", "/block_types/install_system_block_types", None),
]


def _filled(shared: Shared, value: object, run: str) -> object:
    text = json.dumps(value).replace("{deployment}", shared.deployment)
    return json.loads(text.replace("{flow}", shared.flow).replace("{run}", run))


@pytest.mark.parametrize("who", ["vic", "mia"])
def test_each_route_a_role_must_not_reach_is_refused_in_one_sentence(shared, who):
    others = run_of(shared, "max")["id"]
    cases = ADMINS + (WRITES if who == "vic" else [])
    for method, template, body in cases:
        path = str(_filled(shared, template, others))
        answer = shared.ask(who, method, path, _filled(shared, body, others))
        assert answer.status_code == 403, (method, path, answer.status_code, answer.text)
        sentence = answer.json()["detail"]
        assert f"{who} is a {USERS[who]}" in sentence and "ask an admin" in sentence
        assert sentence.count(". ") == 0 and "\n" not in sentence
    # what each may do: read everything but secrets, the viewer; runs of its own, the member
    assert shared.ask(who, "POST", "/flow_runs/filter", {}).status_code == 200
    assert shared.ask(who, "GET", f"/flow_runs/{others}").status_code == 200
    day = {"history_start": "2026-12-06T00:00:00Z", "history_end": "2026-12-07T00:00:00Z"}
    history = dict(day, history_interval_seconds=3600)
    assert shared.ask(who, "POST", "/ui/flow_runs/history", history).status_code == 200
    # an admin may do all of it
    for method, template, body in ADMINS[:1]:
        path = str(_filled(shared, template, others))
        assert shared.ask("ada", method, path, _filled(shared, body, others)).status_code == 204


def test_a_member_changes_only_its_own_runs_and_bulk_changes_are_narrowed(shared):
    mine, theirs = run_of(shared, "mia")["id"], run_of(shared, "max")["id"]
    platforms = shared.ask("owner", "POST", "/flow_runs/", {"flow_id": shared.flow}).json()["id"]
    cancel = {"state": {"type": "CANCELLING"}}
    for run, owner in ((theirs, "max's"), (platforms, "the platform's")):
        refused = shared.ask("mia", "POST", f"/flow_runs/{run}/set_state", cancel)
        assert refused.status_code == 403, refused.text
        assert refused.json()["detail"] == (
            f"flow run {run} is {owner}; mia (a member) may change only its own runs."
        )
        assert shared.ask("mia", "DELETE", f"/flow_runs/{run}").status_code == 403
    done = shared.ask("mia", "POST", f"/flow_runs/{mine}/set_state", cancel)
    assert done.status_code in (200, 201), done.text
    assert shared.ask("vic", "GET", f"/flow_runs/{mine}").json()["state_type"] == "CANCELLED"
    # a log line or a task run of another's run is refused; of its own, taken
    logs = shared.ask("mia", "POST", "/logs/", [dict(LINE, flow_run_id=theirs)])
    assert logs.status_code == 403
    assert shared.ask("mia", "POST", "/logs/", [dict(LINE, flow_run_id=mine)]).status_code == 201
    task = {"name": "t", "task_key": "k", "dynamic_key": "0", "flow_run_id": theirs}
    assert shared.ask("mia", "POST", "/task_runs/", task).status_code == 403
    # a bulk delete of every run deletes only the member's own
    extra = run_of(shared, "mia")["id"]
    bulk = shared.ask("mia", "POST", "/flow_runs/bulk_delete", {"flow_runs": {}})
    assert bulk.status_code == 200, bulk.text
    assert set(bulk.json()["deleted"]) >= {mine, extra}
    assert shared.ask("vic", "GET", f"/flow_runs/{theirs}").status_code == 200
    assert shared.ask("vic", "GET", f"/flow_runs/{platforms}").status_code == 200


def test_secret_values_reach_admins_and_the_platform_only(shared):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    def as_user(who: str):
        return temporary_settings(
            {PREFECT_API_URL: shared.api, PREFECT_API_AUTH_STRING: shared.auth[who]}
        )

    with as_user("owner"):
        Secret(value="hunter2-platform-key").save("registry-key", overwrite=True)
    path = "/block_types/slug/secret/block_documents/name/registry-key"
    for who in ("mia", "vic"):
        refused = shared.ask(who, "GET", path, include_secrets="true")
        assert refused.status_code == 403 and "hunter2" not in refused.text
        assert refused.json()["detail"] == (
            f"block 'registry-key' holds secret values, which only admins and the platform's"
            f" runs read; {who} is a {USERS[who]}."
        )
        listed = shared.ask(who, "POST", "/block_documents/filter", {"include_secrets": True})
        assert listed.status_code == 200 and "hunter2" not in listed.text
        assert "registry-key" in listed.text  # seen, its value obfuscated
        plain = shared.ask(who, "GET", path)
        assert plain.status_code == 200 and "hunter2" not in plain.text
    with as_user("mia"), pytest.raises(Exception, match="holds secret values"):
        Secret.load("registry-key")  # a member's own flow gets the sentence, never ****
    with as_user("ada"):
        assert Secret.load("registry-key").get() == "hunter2-platform-key"


def test_the_audit_trail_names_who_cancelled_a_run(shared):
    run = run_of(shared, "mia")["id"]
    cancel = {"state": {"type": "CANCELLING"}}
    assert shared.ask("mia", "POST", f"/flow_runs/{run}/set_state", cancel).status_code == 201
    other = run_of(shared, "max")["id"]
    assert shared.ask("ada", "POST", f"/flow_runs/{other}/set_state", cancel).status_code == 201
    found = {}
    deadline = time.monotonic() + 180  # events are persisted in batches; slower when busy
    while not {run, other} <= set(found) and time.monotonic() < deadline:
        answer = shared.ask(
            "vic",
            "POST",
            "/events/filter",
            {
                "filter": {
                    "event": {"name": ["gpuflow.audit.flow-run.set-state"]},
                    "occurred": {"since": "2000-01-01T00:00:00Z"},
                },
                "limit": 50,
            },
        )
        for said in answer.json()["events"]:
            [target] = [r for r in said["related"] if r["prefect.resource.role"] == "target"]
            found[target["prefect.resource.id"].rsplit(".", 1)[-1]] = said
        time.sleep(0.3)
    assert found[run]["resource"]["prefect.resource.id"] == "gpuflow.user.mia"
    assert found[run]["payload"]["state"] == "CANCELLING"
    assert found[other]["resource"]["prefect.resource.id"] == "gpuflow.user.ada"
    assert found[other]["resource"]["gpuflow.role"] == "admin"
    # nobody but the platform writes the trail
    forged = [event("gpuflow.audit.flow-run.set-state", "gpuflow.user.max")]
    refused = shared.ask("mia", "POST", "/events", forged)
    assert (
        refused.status_code == 403 and "gpuflow.audit.* events are the platform's" in refused.text
    )


BAD_TOKENS = [  # (Authorization header, what the sentence says)
    ("Bearer abc", "is not `Basic`"),
    ("Basic !!!not-base64", "is not `Basic`"),
    (basic("no-colon-here"), "is not NAME:TOKEN"),
    (basic("mia:gfu_wrong"), "unknown user or wrong token for 'mia'"),
    (basic("nobody:gfu_x"), "unknown user or wrong token for 'nobody'"),
]


@pytest.mark.parametrize(("header", "said"), BAD_TOKENS)
def test_a_token_unknown_or_malformed_is_refused_in_one_sentence(shared, header, said):
    answer = httpx.post(
        shared.api + "/flow_runs/filter", json={}, headers={"Authorization": header}
    )
    assert answer.status_code == 401 and said in answer.json()["detail"], answer.text


def test_a_revoked_token_is_refused_on_the_next_request(shared):
    assert shared.ask("ci", "POST", "/flow_runs/filter", {}).status_code == 200
    shared.book.revoke("ci")
    answer = shared.ask("ci", "POST", "/flow_runs/filter", {})
    assert answer.status_code == 401
    assert answer.json()["detail"].startswith("ci's token was revoked on ")
    renewed = shared.book.add("ci", "member", "service", renew=True)
    assert shared.ask("ci", "POST", "/flow_runs/filter", {}).status_code == 401  # old token
    shared.auth["ci"] = renewed
    assert shared.ask("ci", "POST", "/flow_runs/filter", {}).status_code == 200


async def _socket(shared: Shared, who: str, path: str, event: dict | None = None) -> str:
    """Open a websocket as `who`, authenticate as Prefect's clients do; return "open",
    or "closed: REASON"."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    url = shared.api.replace("http", "ws") + path
    async with connect(url, subprotocols=["prefect"]) as socket:  # type: ignore[list-item]
        await socket.send(json.dumps({"type": "auth", "token": shared.auth[who]}))
        try:
            assert json.loads(await socket.recv()) == {"type": "auth_success"}
            if event is not None:
                await socket.send(json.dumps(event))
            if path.endswith("/out"):
                await socket.send(json.dumps({"type": "filter", "filter": {}}))
            await asyncio.wait_for(socket.recv(), timeout=2)
        except ConnectionClosed as closed:
            return f"closed: {closed.rcvd.reason if closed.rcvd else ''}"
        except TimeoutError:
            pass
        return "open"


def test_websockets_take_the_same_roles(shared):
    viewer_in = asyncio.run(_socket(shared, "vic", "/events/in"))
    assert viewer_in.startswith("closed: vic is a viewer"), viewer_in
    assert asyncio.run(_socket(shared, "vic", "/events/out")) == "open"
    forged = event("gpuflow.audit.x", "y")
    member_forging = asyncio.run(_socket(shared, "mia", "/events/in", forged))
    assert member_forging.startswith("closed: mia may not emit gpuflow.audit.x"), member_forging


def test_the_ui_works_with_a_persons_own_token_and_refuses_what_the_person_cannot(shared):
    assert CHROMIUM is not None, "chromium is not installed; the test command installs it"
    theirs = run_of(shared, "max")
    cancel = json.dumps({"state": {"type": "CANCELLING"}})
    # what the UI sends when its user presses Cancel: the stored login, Basic
    press = f"""fetch('/api/flow_runs/{theirs["id"]}/set_state', {{method: 'POST',
        headers: {{'Content-Type': 'application/json',
                   'Authorization': 'Basic ' + localStorage.getItem('prefect-password')}},
        body: {json.dumps(cancel)}}}).then(async r => r.status + ' ' + await r.text())"""

    async def drive() -> tuple[str, object]:
        with chromium() as endpoint:
            async with tab(endpoint, f"{shared.ui}/runs/flow-run/{theirs['id']}") as page:
                await page.wait_for_text(("</body>",), 60)
                token = base64.b64encode(shared.auth["mia"].encode()).decode()
                await page.evaluate(f"localStorage.setItem('prefect-password', '{token}')")
                await page.call("Page.navigate", url=f"{shared.ui}/runs/flow-run/{theirs['id']}")
                dom = await page.wait_for_text((theirs["name"],), 60)
                answer = await page.call(
                    "Runtime.evaluate", expression=press, awaitPromise=True, returnByValue=True
                )
                return dom, answer["result"]["value"]

    dom, answer = asyncio.run(drive())
    assert theirs["name"] in dom  # the member's UI reads the platform's runs
    assert str(answer).startswith("403 ") and "mia (a member) may change only its own" in answer
    state = shared.ask("vic", "GET", f"/flow_runs/{theirs['id']}").json()["state_type"]
    assert state == "SCHEDULED"


def test_quotas_are_read_by_everyone_and_changed_by_admins_only(shared):
    change = {"team": "vision", "gpus": 8, "scope": "gpu:H100"}
    refused = shared.ask("mia", "PUT", "/gpuflow/quotas", change)
    assert refused.status_code == 403
    assert refused.json()["detail"].startswith("mia is a member (may read, and make and change")
    assert (
        shared.ask("mia", "PUT", "/gpuflow/quotas", {"user": "max", "gpus": 64}).status_code == 403
    )
    assert shared.ask("ada", "PUT", "/gpuflow/quotas", change).status_code == 200
    assert (
        shared.ask("ada", "PUT", "/gpuflow/quotas", {"user": "mia", "gpus": 2}).status_code == 200
    )
    seen = shared.ask("vic", "GET", "/gpuflow/quotas").json()
    assert seen["teams"] == {"vision": {"gpu:H100": 8}} and seen["caps"] == {"mia": 2}
    bad = shared.ask("ada", "PUT", "/gpuflow/quotas", {"team": "vision", "gpus": -1})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("--gpus -1: a quota is 0")
