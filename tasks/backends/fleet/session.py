"""One run's hold on one fleet host: gpuflow's host program (`remote serve`) over one SSH
connection, its claim renewed as a lease, its units' lines, samples and ends read back."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuflow.tasks.contract import UnitEnd, WorkUnit
from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE, ProvisionError
from gpuflow.tasks.ssh import SSH_FAILED, SshTarget

ANSWER_S = 60.0  # the host's first answer (claimed or busy) comes within this


class Busy(Exception):
    """The host has not enough free GPUs now (its words)."""


class UnitWatch:
    """What the host said of one unit: its lines go to `on_line`, its samples to
    `on_sample`, its end is kept."""

    def __init__(
        self, on_line: Callable[[str, str], None], on_sample: Callable[[dict], None]
    ) -> None:
        self.on_line, self.on_sample = on_line, on_sample
        self.end: UnitEnd | None = None
        self.changed = threading.Event()


class HostSession:
    """gpuflow's host program on one host, serving one run."""

    def __init__(
        self, ssh: SshTarget, host: str, address: str, command_for: Callable[[list[str]], str]
    ) -> None:
        self.ssh, self.host, self.address = ssh, host, address
        self.command_for = command_for  # the shell command running the host program with argv
        self.command = command_for(["serve"])
        self.proc: subprocess.Popen | None = None
        self.claimed: dict[str, Any] = {}
        self.lost: str | None = None  # why the host is gone for this run
        self.lost_at = 0.0
        self.down: dict[str, Any] | None = None
        self.units: dict[str, UnitWatch] = {}
        self.answered = time.monotonic()
        self._first: dict[str, Any] | None = None
        self._first_seen = threading.Event()
        self._lock = threading.Lock()
        self._stderr: list[str] = []
        self._stopping = threading.Event()

    def open(self, request: dict[str, Any], lease_s: float) -> dict[str, Any]:
        """Ask the host for GPUs; return what it claimed. Busy when it has too few free,
        ProvisionError (its real cause) when it cannot be reached or refuses."""
        self.lease_s, self.request = lease_s, request
        self.proc = self.ssh.start(self.command)
        assert self.proc.stdin is not None
        self._send({**request, "lease_s": lease_s})
        threading.Thread(target=self._read, name=f"fleet-{self.host}", daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()
        if not self._first_seen.wait(ANSWER_S):
            self.close()
            raise ProvisionError(f"{self.ssh} did not answer within {ANSWER_S:.0f} s")
        first = self._first or {}
        if "claimed" in first:
            self.claimed = first["claimed"]
            threading.Thread(target=self._renew, name=f"lease-{self.host}", daemon=True).start()
            return self.claimed
        self.close()
        if "busy" in first:
            raise Busy(first["busy"])
        if "error" in first:
            raise ProvisionError(f"{self.ssh}: {first['error']}")
        code = self.proc.wait()
        said = "\n".join(self._stderr)
        if code == SSH_FAILED:
            raise ProvisionError(self.ssh.failure(said))
        raise ProvisionError(f"gpuflow's host program on {self.ssh} ended (exit {code}): {said}")

    def fenced_at(self) -> float:
        """Return when (monotonic) the host has surely stopped this run's units, had it
        lost touch with this process: nothing was sent after the loss was seen (the
        connection was closed), a renewal sent before may still have reached it, so its
        lease lapses at most a lease after that; a unit then gets its grace and a SIGKILL."""
        grace = float(self.request.get("grace_s") or 30.0)
        return self.lost_at + self.lease_s + grace + 5.0

    def _send(self, message: dict[str, Any]) -> bool:
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            with self._lock:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            self.answered = time.monotonic()
            if self._first is None:
                self._first = message
                self._first_seen.set()
                continue
            self._dispatch(message)
        self._first_seen.set()
        if self.down is None and self.lost is None and not self._stopping.is_set():
            said = "; ".join(self._stderr[-3:]) or "the connection closed"
            self._lose(f"the connection to {self.ssh} was lost ({said})")

    def _read_errors(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            text = raw.decode(errors="replace").strip()
            if text:
                self._stderr.append(text)
                del self._stderr[:-20]

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "down" in message:
            self.down = message
            for each in self.units.values():
                each.changed.set()
            return
        name = message.get("unit") or message.get("end")
        watch = self.units.get(str(name)) if name else None
        if watch is None:
            return
        if "line" in message:
            watch.on_line(str(message.get("stream", "stdout")), str(message["line"]))
        elif "sample" in message:
            watch.on_sample(message["sample"])
        elif "end" in message:
            if "error" in message:
                watch.on_line("stderr", str(message["error"]))
                watch.end = UnitEnd(exit_code=127)
            else:
                watch.end = UnitEnd.model_validate(message["result"])
            watch.changed.set()

    def _renew(self) -> None:
        every = max(1.0, self.lease_s / 4)
        while not self._stopping.wait(every):
            if self.lost is not None or self.down is not None:
                return
            self._send({"op": "renew"})
            silent = time.monotonic() - self.answered
            if silent > self.lease_s:
                self._lose(
                    f"{self.ssh} has not answered for {silent:.0f} s (its network or sshd is"
                    " gone); its lease lapses there and its units stop"
                )
                return

    def _lose(self, why: str) -> None:
        self.lost_at = time.monotonic()
        self.lost = why
        for watch in self.units.values():
            if watch.end is None:
                watch.end = UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[why])
            watch.changed.set()
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()

    def run(
        self,
        unit_id: str,
        unit: WorkUnit,
        env: dict[str, str],
        on_line: Callable[[str, str], None],
        on_sample: Callable[[dict], None],
    ) -> UnitWatch:
        """Start `unit` on the host (its variables, secrets too, go over the connection,
        never a command line); return what watches it."""
        watch = UnitWatch(on_line, on_sample)
        self.units[unit_id] = watch
        if self.lost is not None or not self._send(
            {"op": "run", "id": unit_id, "unit": unit.model_dump(mode="json"), "env": env}
        ):
            watch.end = UnitEnd(
                exit_code=PREEMPTED_EXIT_CODE, tail=[self.lost or f"{self.ssh} is gone"]
            )
        return watch

    def stop(self, unit_id: str, grace_s: float) -> None:
        self._send({"op": "stop", "unit": unit_id, "grace_s": grace_s})

    def teardown(self, wait_s: float) -> dict[str, Any] | None:
        """Ask the host to stop the run's units, release its GPUs and remove its workspace;
        return its report (None when it could not be asked)."""
        if self.lost is None and self._send({"op": "teardown"}):
            until = time.monotonic() + wait_s
            while self.down is None and self.lost is None and time.monotonic() < until:
                time.sleep(0.05)
        self.close()
        return self.down.get("report") if self.down else None

    def close(self) -> None:
        self._stopping.set()
        if self.proc is not None:
            with contextlib.suppress(OSError, ValueError):
                if self.proc.stdin:
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
