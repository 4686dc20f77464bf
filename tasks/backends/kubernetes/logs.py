"""A Kubernetes unit's log, followed: its lines to the run as the pod prints them; the
metric samples of its node, and the output files the unit wrapper (manifests.UNIT_WRAPPER)
prints at its end, written into the run's workspace instead."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import secrets
import threading
from pathlib import Path, PurePosixPath

from gpuflow.tasks.backends.kubernetes import manifests as objects
from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi
from gpuflow.tasks.contract import LineSink

# This process's key: the nonce of a cluster's pods is derived from it and the cluster's
# name, the same for every unit this process runs there, known to no job.
_NONCE_KEY = secrets.token_bytes(32)


def log_nonce(cluster_name: str) -> str:
    """Return the nonce the unit wrapper's log records carry for `cluster_name`'s pods."""
    return hmac.new(_NONCE_KEY, cluster_name.encode(), hashlib.sha256).hexdigest()[:24]


class LogFollower:
    """Streams a running pod's log lines to the sink in a thread of its own, and writes the
    output files the unit's wrapper prints at its end into `outputs` (not to the sink)."""

    def __init__(
        self,
        api: KubeApi,
        on_line: LineSink,
        outputs: Path,
        samples: Path | None = None,
        nonce: str = "",
        notes: LineSink | None = None,
    ) -> None:
        self.api, self.on_line, self.outputs = api, on_line, outputs
        # what gpuflow says of the outputs the wrapper sent (default: with the job's lines)
        self.notes = notes or on_line
        # the wrapper's records carry the run's nonce: a job's own line never passes for one
        self.sample_mark = f"{objects.SAMPLE_MARK}-{nonce} "
        self.output_mark = f"{objects.OUTPUT_MARK}-{nonce}"
        self.left_mark = f"{objects.OUTPUT_LEFT_MARK}-{nonce}"
        self.samples = samples  # where the node's samples go, one JSON line each
        self.thread: threading.Thread | None = None
        self.path: str | None = None
        self.seen = 0  # lines of the log taken so far (every read starts at its first line)
        self.lock = threading.Lock()  # one reader takes lines at a time
        self.stopping = False  # stop now
        self.ended = False  # the pod ended: read what is left, then stop
        self.wake = threading.Event()

    def start(self, path: str, follow: bool = True) -> None:
        """Stream the log at `path` (once: a second call changes nothing)."""
        if self.thread is not None:
            return
        self.path = path
        self.thread = threading.Thread(target=self._pump, args=(path, follow), daemon=True)
        self.thread.start()

    def _pump(self, path: str, follow: bool) -> None:
        """Read the log; a stream that fails or ends while the pod may still run is opened
        again (lines already seen are skipped), waiting longer each time it yields nothing.
        Once the pod ended the log is read to its end without following, then it stops."""
        pause, last_tries = 1.0, 3
        while not self.stopping:
            last = not follow or self.ended
            try:
                if self._read(path, follow=not last):
                    pause = 1.0
                if last:
                    return
            except Exception:  # no log yet, a dropped stream: read on
                if last:  # the last read failed: try it again, a little later
                    last_tries -= 1
                    if not last_tries:
                        return
                    self.wake.clear()
                    pause = 0.5
            self.wake.wait(pause)  # the pod ending wakes it for one last read
            pause = min(pause * 2, 10.0)

    def _read(self, path: str, follow: bool, final: bool = False) -> bool:
        """Take the lines of one read of the log past those seen; say whether any came."""
        params = {"follow": "true" if follow else "false", "container": "unit"}
        taken = False
        for count, line in enumerate(self.api.stream(path, params), start=1):
            with self.lock:
                if self.stopping and not final:
                    return taken
                if count > self.seen:
                    self.seen, taken = count, True
                    self._line(line)
        return taken

    def _line(self, line: str) -> None:
        before, mark, sample = line.rpartition(self.sample_mark)
        if mark and not before:
            self._sample(sample)
            return
        if mark and self._sample(sample):
            # a sample that landed in a line the job left unfinished (a progress bar): the
            # sample is kept, and the job's text before it is the job's line
            line = before
        if line.startswith((self.output_mark + " ", self.left_mark + " ")):
            with contextlib.suppress(ValueError):  # not the wrapper's shape: an ordinary line
                self._receive(line)
                return
        self.on_line("stdout", line)

    def _sample(self, text: str) -> bool:
        """Keep one sample of the pod's node and say whether it was one (a torn one is
        dropped: the next follows)."""
        try:
            if not isinstance(json.loads(text), dict):
                return False
        except (ValueError, RecursionError):  # torn, or not JSON a sampler writes
            return False
        if self.samples is not None:
            with contextlib.suppress(OSError), self.samples.open("a") as out:
                out.write(text + "\n")
        return True

    def _receive(self, line: str) -> None:
        """Write one output file the unit sent back, or say why one stayed in the pod; raise
        ValueError, nothing written, for a line not in the wrapper's shape."""
        mark, rest = line.split(" ", 1)
        if mark == self.left_mark:
            size, name = rest.split(" ", 1)
            size_mib = int(size) / 2**20
            self.notes(
                "stderr",
                f"outputs/{name} ({size_mib:.1f} MiB) stayed in the pod: files over"
                f" {objects.OUTPUT_MAX_KIB} KiB come back only from storage (write them to"
                " your job's output URL)",
            )
            return
        name, data = rest.rsplit(" ", 1)
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            self.notes("stderr", f"outputs/{name} was not taken: it would land outside outputs")
            return
        try:
            content = base64.b64decode(data, validate=True)
        except ValueError:
            self.notes("stderr", f"outputs/{name} arrived damaged and was not kept")
            return
        target = self.outputs.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)

    def read_to_end(self, path: str) -> None:
        """Read the log of an ended pod once, to its end (no thread)."""
        self._read(path, follow=False, final=True)

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop streaming, after up to `drain_s` for a log whose pod ended to be read out. A
        stream still open then (a kubelet that keeps following an ended container's log) is
        left, and the log is read once more to its end here: its last lines are not lost."""
        self.ended = True
        self.wake.set()
        if self.thread is not None and drain_s:
            self.thread.join(timeout=drain_s)
        with self.lock:
            self.stopping = True
        if self.thread is None:
            return
        self.thread.join(timeout=2)
        if drain_s and self.thread.is_alive() and self.path is not None:
            with contextlib.suppress(Exception):  # the log is gone with its pod: nothing left
                self._read(self.path, follow=False, final=True)
