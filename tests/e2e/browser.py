"""Headless Chromium driven over the DevTools protocol, for pages that need what a user's
browser holds: the Prefect UI keeps the auth string a user typed in its localStorage
(`prefect-password`, base64), and sends it with every API call."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from gpuflow.tasks.host import stop_group

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab, talked to over the browser's DevTools websocket."""

    def __init__(self, socket: Any, session: str) -> None:
        self.socket, self.session = socket, session
        self.ids = itertools.count(1000)

    async def call(self, method: str, **params: Any) -> dict:
        return await _call(self.socket, method, params, self.ids, self.session)

    async def key(self, key: str) -> None:
        """Press and release `key` (a DOM key name: ArrowRight, a) as a user's keyboard does."""
        codes = {"ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40}
        code = codes.get(key, ord(key.upper()) if len(key) == 1 else 0)
        for kind in ("rawKeyDown", "keyUp"):
            await self.call(
                "Input.dispatchKeyEvent", type=kind, key=key, windowsVirtualKeyCode=code, code=key
            )

    async def wait_until(self, expression: str, timeout_s: float) -> Any:
        """Return `expression`'s value once it is truthy; AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            assert time.monotonic() < deadline, f"{expression} within {timeout_s:.0f} s"
            await asyncio.sleep(0.2)
        return value

    async def evaluate(self, expression: str) -> Any:
        answer = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return answer.get("result", {}).get("value")

    async def wait_for_text(self, texts: tuple[str, ...], timeout_s: float) -> str:
        """Return the page's HTML once it holds every one of `texts` (else as it is after
        `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            dom = await self.evaluate("document.documentElement.outerHTML") or ""
            if all(text in dom for text in texts) or time.monotonic() > deadline:
                return dom
            await asyncio.sleep(0.25)


async def _call(socket: Any, method: str, params: dict, ids: Any, session: str | None) -> dict:
    message_id = next(ids)
    message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
    if session:
        message["sessionId"] = session
    await socket.send(json.dumps(message))
    while True:
        answer = json.loads(await socket.recv())
        if answer.get("id") == message_id:
            if "error" in answer:
                raise RuntimeError(f"{method}: {answer['error']}")
            return answer.get("result", {})


def ui_page(
    url: str,
    auth: str | None,
    wait_for: tuple[str, ...],
    screenshot: Path | None = None,
    timeout_s: float = 60.0,
    probe: str | None = None,
) -> Any:
    """Return the HTML of the Prefect UI page `url` once it shows all of `wait_for`, as a
    user who typed `auth` into the UI's login (None: one who typed nothing); save a PNG
    of it to `screenshot` when given. With `probe` (a JavaScript expression), return the
    HTML and the expression's value once it is truthy (or as it is after `timeout_s`)."""
    with chromium() as endpoint:
        return asyncio.run(_load(endpoint, url, auth, wait_for, screenshot, timeout_s, probe))


@contextlib.contextmanager
def chromium(window: str = "1400,1000") -> Iterator[str]:
    """Start headless Chromium; yield its DevTools websocket URL; stop it and its children."""
    assert CHROMIUM is not None, "chromium is not installed; the test command installs it"
    with tempfile.TemporaryDirectory(
        prefix="gpuflow-chromium-", ignore_cleanup_errors=True
    ) as profile:
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu"]
        argv += ["--disable-dev-shm-usage", f"--window-size={window}"]
        argv += ["--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]
        browser = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            active = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (active.is_file() and len(active.read_text().split()) == 2):
                assert browser.poll() is None, "chromium exited before it listened"
                assert time.monotonic() < deadline, "chromium never opened its DevTools port"
                time.sleep(0.1)
            port, path = active.read_text().split()
            yield f"ws://127.0.0.1:{port}{path}"
        finally:
            stop_group(browser.pid, None, grace_s=5.0)  # its renderers and zygote too
            browser.wait(timeout=30)


@contextlib.asynccontextmanager
async def tab(endpoint: str, url: str) -> AsyncIterator[Page]:
    """Open `url` in a new tab of the browser at `endpoint`; yield it; close it."""
    from websockets.asyncio.client import connect

    async with connect(endpoint, max_size=64 * 1024 * 1024) as socket:
        ids = itertools.count(1)
        target = await _call(socket, "Target.createTarget", {"url": "about:blank"}, ids, None)
        attached = await _call(
            socket, "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
            ids, None,
        )  # fmt: skip
        page = Page(socket, attached["sessionId"])
        await page.call("Page.navigate", url=url)
        try:
            yield page
        finally:
            with contextlib.suppress(Exception):
                await _call(
                    socket, "Target.closeTarget", {"targetId": target["targetId"]}, ids, None
                )


async def _load(
    endpoint: str,
    url: str,
    auth: str | None,
    wait_for: tuple[str, ...],
    screenshot: Path | None,
    timeout_s: float,
    probe: str | None = None,
) -> Any:
    async with tab(endpoint, url) as page:
        if auth is not None:  # as the login form does: the string, base64, in localStorage
            await page.wait_for_text(("</body>",), timeout_s)
            token = base64.b64encode(auth.encode()).decode()
            await page.evaluate(f"localStorage.setItem('prefect-password', {json.dumps(token)})")
            await page.call("Page.navigate", url=url)
        dom = await page.wait_for_text(wait_for, timeout_s)
        value = None
        if probe is not None:  # a condition on what the page drew, waited for
            deadline = time.monotonic() + timeout_s
            while not (value := await page.evaluate(probe)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        if screenshot is not None:
            shot = await page.call("Page.captureScreenshot", format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        return dom if probe is None else (dom, value)
