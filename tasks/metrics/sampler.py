"""A background thread that samples GPUs (NVML, DCGM-exporter names) and the host.

Each sample is one JSON line in a file, so a crash loses at most one sample and
collect can read them from any process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import psutil

from gpuflow.tasks.nvml import load_nvml

logger = logging.getLogger(__name__)

GPU_FIELDS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
)


SAMPLES = ".gpuflow-samples.jsonl"  # a run's samples, in its cluster's workspace
# where a node's sampler writes while its units run, beside SAMPLES (joined into it after)
NODE_SAMPLES = ".gpuflow-samples-*.jsonl"


class Sampler:
    """Samples every `interval_s` into `path` until stopped; use as a context manager."""

    def __init__(
        self,
        path: Path,
        gpu_indices: list[int],
        interval_s: float = 1.0,
        nvml_module: types.ModuleType | None = None,
        on_sample: Callable[[dict[str, Any]], None] | None = None,
        stream: TextIO | None = None,
        mark: str = "",
    ) -> None:
        self.path = Path(path)
        # instead of the file: a stream (a pod's log) whose lines carry `mark` first
        self.stream, self.mark = stream, mark
        self.gpu_indices = gpu_indices
        self.interval_s = interval_s
        self.hostname = socket.gethostname()
        self._nvml = load_nvml(nvml_module) if gpu_indices else None
        self._handles: list[tuple[int, Any, str, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_sample = on_sample
        self.gpu_error: str | None = None
        self.write_error: str | None = None  # the first sample that could not be written
        self.count = 0
        self.lost = 0  # samples that could not be written

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._open_nvml()
        psutil.cpu_percent(interval=None)  # first call primes the counter
        if self.stream is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="gpuflow-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        self._sample_once()  # the last sample closes the energy and time window
        if self._handles and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                logger.debug("nvmlShutdown failed", exc_info=True)

    def _open_nvml(self) -> None:
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlInit()
            for index in self.gpu_indices:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                name = self._nvml.nvmlDeviceGetName(handle)
                uuid = self._nvml.nvmlDeviceGetUUID(handle)
                self._handles.append((index, handle, _text(uuid), _text(name)))
        except Exception as exc:
            self.gpu_error = f"NVML unavailable: {exc}"
            self._handles = []

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        sample = {
            "t": time.time(),
            "Hostname": self.hostname,
            "host": {
                "cpu_percent": psutil.cpu_percent(interval=None),
                "memory_used_bytes": psutil.virtual_memory().used,
            },
            "gpus": [
                self._gpu(index, handle, uuid, name) for index, handle, uuid, name in self._handles
            ],
        }
        try:
            if self.stream is not None:
                self.stream.write(f"{self.mark}{json.dumps(sample)}\n")
                self.stream.flush()
            else:
                with self.path.open("a") as out:
                    out.write(json.dumps(sample) + "\n")
        except OSError as exc:  # a full disk: the job goes on, and so does sampling
            self.lost += 1
            if self.write_error is None:
                self.write_error = f"{self.path}: {exc.strerror or exc}"
                logger.warning(
                    "samples can not be written to %s; sampling goes on and writes again once"
                    " there is room",
                    self.write_error,
                )
        else:
            self.count += 1
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # a consumer's failure must not stop sampling
                logger.warning("sample consumer failed", exc_info=True)

    def _gpu(self, index: int, handle: Any, uuid: str, name: str) -> dict[str, Any]:
        nvml: Any = self._nvml  # set: a GPU is only read once NVML answered
        reading: dict[str, Any] = {"gpu": index, "UUID": uuid, "modelName": name}
        probes = {
            "DCGM_FI_DEV_GPU_UTIL": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "DCGM_FI_DEV_FB_USED": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
            "DCGM_FI_DEV_POWER_USAGE": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "DCGM_FI_DEV_GPU_TEMP": lambda: nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU
            ),
            "DCGM_FI_DEV_SM_CLOCK": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda: (
                nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            ),
        }
        for field, probe in probes.items():
            try:
                reading[field] = float(probe())
            except Exception:  # a field this GPU does not support stays absent
                continue
        return reading


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Return the samples written to `path`, skipping a torn last line."""
    samples = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return samples


class SampleTail:
    """Samples that other machines write into a shared folder (files matching `pattern`),
    handed to `on_sample` as they come: a thread reads the whole lines each file gained
    every `interval_s`, and once more when it stops. A file removed meanwhile (its samples
    joined the run's) is forgotten. `named`: on_sample gets the file's name too."""

    def __init__(
        self,
        folder: Path,
        pattern: str,
        on_sample: Callable[..., None],
        interval_s: float = 1.0,
        named: bool = False,
    ) -> None:
        self.folder, self.pattern, self.on_sample = Path(folder), pattern, on_sample
        self.interval_s, self.named = interval_s, named
        self._read: dict[Path, int] = {}  # file -> bytes handed on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sample-tail", daemon=True)

    def __enter__(self) -> SampleTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            self.read_new()
            if stopping:
                return

    def read_new(self) -> None:
        """Hand on the samples the files gained since the last read."""
        for path in sorted(self.folder.glob(self.pattern)):
            done = self._read.get(path, 0)
            try:
                with path.open("rb") as source:
                    source.seek(done)
                    data = source.read()
            except FileNotFoundError:
                self._read.pop(path, None)
                continue
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self._read[path] = done + len(whole)
            for line in whole.splitlines():
                try:
                    sample = json.loads(line)
                except ValueError:
                    continue
                if self.named:
                    self.on_sample(sample, path.name)
                else:
                    self.on_sample(sample)


def main(argv: list[str] | None = None) -> int:
    """Sample this node's GPUs into a file until SIGTERM (or SIGINT), then write the last
    sample and exit 0: `python -m gpuflow.tasks.metrics.sampler --out F --gpus 0,1 [--interval S]
    [--host NAME] [--until-pid PID]`. A backend starts it on each node that runs a unit (Slurm: a step beside
    the unit's; Kubernetes: in each unit's pod, `--out -` printing each sample as one line
    of the pod's log, after `--mark`)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m gpuflow.tasks.metrics.sampler")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--gpus", default="", help="GPU indices, comma-separated")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--host", default=None, help="the node's name in the samples")
    parser.add_argument(
        "--mark",
        default=os.environ.get("GPUFLOW_SAMPLE_MARK", ""),
        help="with --out -: what each line starts with (default: $GPUFLOW_SAMPLE_MARK, which"
        " no other process's command line shows)",
    )
    parser.add_argument("--until-pid", type=int, help="also stop once this process is gone")
    args = parser.parse_args(argv)
    indices = [int(i) for i in args.gpus.split(",") if i.strip()]
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    import sys

    to_log = str(args.out) == "-"
    sampler = Sampler(
        args.out, indices, args.interval, stream=sys.stdout if to_log else None, mark=args.mark
    )
    if args.host:
        sampler.hostname = args.host
    with sampler:
        if not to_log:  # the backend waits for this line: sampling has begun
            print("sampling", flush=True)
        while not stop.wait(0.2):
            if args.until_pid and not _alive(args.until_pid):
                break
    return 0


def _alive(pid: int) -> bool:
    """Return True while process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


if __name__ == "__main__":
    raise SystemExit(main())
