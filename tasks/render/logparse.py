"""Blender's log, read line by line: progress, saved frames, times, errors. Pure.

Tolerant of prefixes newer Blenders put before the classic text (timestamps, log
categories): each pattern is searched for, not anchored at the line's start.
Blender exits 0 after several failures, so `classify` reads the log, not the exit code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuflow.tasks import diagnose

_FRA = re.compile(r"\bFra:(\d+)\b")
_CYCLES = re.compile(r"\| Sample (\d+)/(\d+)")
_EEVEE = re.compile(r"\| Rendering (\d+) / (\d+) samples")
_SAVED = re.compile(r"Saved: '(.+)'")
_TIME = re.compile(r"^\s*(?:\S+\s+)?Time: (?:(\d+):)?(\d+):(\d+(?:\.\d+)?)")
_ERROR = re.compile(r"(?:^|\| |\s)Error: (.+)$")


@dataclass
class RenderLog:
    """What a Blender run said, accumulated from its lines."""

    current_frame: int | None = None
    samples: tuple[int, int] | None = None
    saved: dict[int, str] = field(default_factory=dict)
    frame_seconds: dict[int, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    python_error: str | None = None
    _in_traceback: bool = False

    def feed(self, line: str) -> None:
        """Take one line of Blender's output."""
        text = line.rstrip("\n")
        if self._in_traceback:
            if text and not text.startswith((" ", "Traceback")):
                self.python_error = text.strip()
                self._in_traceback = False
            return
        if fra := _FRA.search(text):
            self.current_frame = int(fra.group(1))
            progress = _CYCLES.search(text) or _EEVEE.search(text)
            if progress:
                self.samples = (int(progress.group(1)), int(progress.group(2)))
        if saved := _SAVED.search(text):
            if self.current_frame is not None:
                self.saved[self.current_frame] = saved.group(1)
            return
        if (took := _TIME.match(text)) and self.current_frame is not None:
            hours, minutes, seconds = took.groups()
            self.frame_seconds[self.current_frame] = (
                int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)
            )
            return
        if error := _ERROR.search(text):
            message = error.group(1).strip()
            if message.startswith("Python: Traceback"):
                self._in_traceback = True
            elif not _FRA.search(text):  # Fra lines repeat the error that follows them
                self.errors.append(message)


def saved_path(line: str) -> str | None:
    """Return the file a `Saved: '...'` line names, else None."""
    found = _SAVED.search(line)
    return found.group(1) if found else None


def frame_time(line: str) -> float | None:
    """Return the seconds a ` Time: MM:SS.ss` line (after Saved) gives, else None.
    Workbench renders print no Fra: lines, so this does not need one."""
    took = _TIME.match(line)
    if not took:
        return None
    hours, minutes, seconds = took.groups()
    return int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)


def parse(text: str) -> RenderLog:
    log = RenderLog()
    for line in text.splitlines():
        log.feed(line)
    return log


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str
    transient: bool = False


def classify(log: RenderLog, exit_code: int | None, signal: int | None = None) -> Failure | None:
    """Return why a Blender run failed, in a sentence, or None when its log shows no failure
    (the frames' files are still to be checked)."""
    for error in log.errors:  # Blender's rows of gpuflow's one table of causes
        if known := diagnose.match([error], "blender"):
            return Failure(known.kind, known.message)
    if log.python_error:
        return Failure(
            "python_error",
            f"the settings script failed ({log.python_error}); nothing it set took effect",
        )
    if signal is not None:
        hint = " (SIGKILL: often the out-of-memory killer)" if signal == 9 else ""
        return Failure("crashed", f"Blender was killed by signal {signal}{hint}", transient=True)
    if log.errors:
        return Failure("error", f"Blender reported: {log.errors[0]}")
    if exit_code:
        return Failure(
            "exit", f"Blender exited with code {exit_code} without saying why", transient=True
        )
    return None
