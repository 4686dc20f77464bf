"""The Backend protocol: the verbs every backend speaks, and what each does on retry and
when things are already gone."""

from __future__ import annotations

import abc
import contextlib
import math
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

from gpuflow.tasks.contract import (
    Capabilities,
    Cluster,
    JobResult,
    LineSink,
    Needs,
    Offer,
    ReapReport,
    Replicated,
    RunStates,
    StopCheck,
    StopReason,
    TeardownReport,
    UnitEnd,
    WorkUnit,
)
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import STOP_GRACE_S, signals_deferred, stop_group
from gpuflow.tasks.metrics.cost import ListPrices, PriceTable
from gpuflow.tasks.spec import JobSpec, Placement
from gpuflow.tasks.storage import S3Settings, store_for


class UnitHandle(Protocol):
    """What a backend gives `follow_unit` for one started unit: how to see its end, wait,
    and stop it on its kind of machine."""

    def poll(self) -> UnitEnd | None:
        """Return the unit's end once it ended, else None. May raise (a pod that can never
        be placed: ProvisionError; GPUs that stay busy: CapacityError)."""

    def wait(self, seconds: float) -> None:
        """Wait up to `seconds` for something to change (sooner when the unit ends)."""

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd | None:
        """Stop the unit for `reason`: SIGTERM, `grace_s` to save its state, SIGKILL. Return
        its end when known at once; None to keep polling for it."""

    def interrupt(self, grace_s: float) -> None:
        """This process is going down: stop the unit the same way, without waiting long."""

    def unconfirmed(self) -> UnitEnd:
        """Return the end to report when a stopped unit never confirmed its end."""


class StartedUnit(UnitHandle, Protocol):
    """A unit a backend started (`UnitBackend.start`): a handle for `follow_unit`, how
    often to look at it, and what to do once it is over."""

    every_s: float  # how often follow_unit polls it

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Called once whatever happened (end None: this process was interrupted): read
        the unit's last lines, outputs and samples, release what following it held;
        return its end with what was learned."""


TAIL_LINES = 40  # the last lines of a unit's log kept in its result


class LogTail:
    """A unit's line sink: every line goes on to the run's, the last TAIL_LINES are kept
    for its result (and for the failure sentence)."""

    def __init__(self, on_line: LineSink) -> None:
        self.on_line = on_line
        self._last: deque[str] = deque(maxlen=TAIL_LINES)

    def __call__(self, stream: str, text: str) -> None:
        self._last.append(text)
        self.on_line(stream, text)

    def note(self, text: str) -> None:
        """Add a line of gpuflow's own about the unit (a lost node), on stderr."""
        self("stderr", text)

    def lines(self) -> list[str]:
        return list(self._last)


_SAMPLES_LOCK = threading.Lock()  # units end in threads of their own: one joins at a time


def join_samples(samples: Path, node_samples: bytes | Path) -> None:
    """Append a unit's node samples (JSON lines, or a file of them, removed once added)
    to the run's `samples`; a file that is not there adds nothing."""
    with _SAMPLES_LOCK, contextlib.suppress(OSError):
        data = node_samples if isinstance(node_samples, bytes) else node_samples.read_bytes()
        if data:
            with samples.open("ab") as out:
                out.write(data if data.endswith(b"\n") else data + b"\n")
        if isinstance(node_samples, Path):
            node_samples.unlink()


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int:
    """Stop one child process: SIGTERM, `grace_s` to end, then SIGKILL; return its code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class UnitBackend(abc.ABC):
    """What every backend derives from: the verbs of `Backend` it must give (abstract here,
    so a type checker, and Python when it is made, refuse one that leaves a verb out), and
    those written once: `run` (a backend says how to `start` a unit; following it to its
    end, its log tail and its result are here), `describe`, `stage`, `outputs_here`."""

    name: ClassVar[str]
    placement_model: ClassVar[type[Placement]] = Placement  # none of its own: the shared fields
    capabilities: ClassVar[Capabilities]
    extra: ClassVar[str | None] = None  # the gpuflow extra it needs here (tasks/extras.py)
    list_prices: ClassVar[ListPrices] = ListPrices()  # its default prices (none: free)

    @classmethod
    @abc.abstractmethod
    def at(cls, placement: Placement | None = None) -> Self:
        """See Backend.at."""

    @classmethod
    @abc.abstractmethod
    def of(cls, cluster: Cluster) -> Self:
        """See Backend.of."""

    @classmethod
    def block_types(cls) -> list[type]:
        """Return the Prefect block types its settings are saved in (`gpuflow blocks init`
        registers them); imported when asked, as a block type may need an extra."""
        return []

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> Self:
        """See Backend.reaper: by default the backend of a placement naming `block`."""
        return cls.at(cls.placement_model(backend=cls.name, block=block))

    @abc.abstractmethod
    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """See Backend.configure."""

    @abc.abstractmethod
    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """See Backend.check."""

    def job_argv(self, cluster: Cluster) -> Callable[[list[str]], list[str]]:
        """See Backend.job_argv. This default: the command as it is."""
        return list

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """See Backend.pin_image. This default: the spec as it is where the backend runs
        images and resolves them itself (a Kubernetes node pulls its pods' image); one
        sentence where it runs none."""
        if spec.image is not None and not self.capabilities.runs_images:
            raise InvalidSpec(
                f"image: the {self.name} backend does not run jobs in images yet; remove image"
                " to run on its hosts' own programs, or choose placement.backend local or"
                " kubernetes."
            )
        return spec

    @abc.abstractmethod
    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """See Backend.offers."""

    @abc.abstractmethod
    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """See Backend.provision."""

    @abc.abstractmethod
    def teardown(self, cluster: Cluster) -> TeardownReport:
        """See Backend.teardown."""

    @abc.abstractmethod
    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """See Backend.list_owned."""

    @abc.abstractmethod
    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """See Backend.reap."""

    @abc.abstractmethod
    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> StartedUnit:
        """Start `unit` on its node with `env` (the backend adds what its nodes need and
        the unit's own env over it), its lines going to `tail`; return its handle.
        Raises InvalidSpec or ProvisionError when it cannot start."""

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Return where the nodes of `cluster` read `path`, a file on this machine named by
        its content: under `staging` (uploaded once; kept there, by name, for the next run)
        when given, else the path itself, for nodes that read this machine's files."""
        if staging:
            url = f"{staging.rstrip('/')}/{path.name}"
            store = store_for(url, storage)
            if not store.exists(url):
                store.upload_file(url, path)
            return url
        capabilities = self.capabilities
        if not (capabilities.runs_here or capabilities.local_files):
            raise InvalidSpec(
                f"job.workdir: the job runs on {capabilities.where}, which cannot read this"
                " machine's files; set storage.staging to an s3:// prefix they reach."
            )
        return str(path)

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        """Return preflight rows for `spec` from what every backend answers: its `check`
        (a fail row with the sentence) and its `offers` (a row each: GPUs free, whether it
        could start now and why not). A backend with more to say overrides it."""
        where = self.capabilities.where
        rows = [
            {"name": "backend", "level": "pass", "message": f"{spec.placement.backend}: {where}"}
        ]
        try:
            self.check(spec)
            offers = self.offers(spec, PriceTable())
        except InvalidSpec as exc:
            return [*rows, {"name": "check", "level": "fail", "message": str(exc)}]
        for offer in offers:
            free = "unknown" if offer.gpus_free is None else str(offer.gpus_free)
            product = f" {offer.gpu_product}" if offer.gpu_product else ""
            state = "can start now" if offer.can_start else f"cannot start now: {offer.why_not}"
            message = f"{offer.where}: GPUs{product} free {free}; {state}"
            rows.append({"name": "offer", "level": "pass" if offer.can_start else "warn",
                         "message": message})  # fmt: skip
        if not offers:
            rows.append({"name": "offer", "level": "fail", "message": "nothing here fits the job"})
        return rows

    @contextlib.contextmanager
    def outputs_here(self, cluster: Cluster) -> Iterator[Path]:
        """Yield the folder here holding what `cluster`'s job wrote: its workspace's
        `outputs`, where a unit's end brings them. A backend whose nodes keep them
        elsewhere (a host's disk, a mailbox, a pod's log) brings them here first, and lets
        its own copy go once the caller is done without error."""
        yield Path(cluster.workspace) / "outputs"

    def run(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        on_line: LineSink,
        should_stop: StopCheck | None = None,
        grace_s: float = STOP_GRACE_S,
    ) -> JobResult:
        """Run `unit` (see Backend.run): start it, follow it to its end, return its result."""
        tail = LogTail(on_line)
        started = datetime.now(UTC)
        handle = self.start(cluster, unit, env, timeout_s, tail)
        end: UnitEnd | None = None
        try:
            end = follow_unit(handle, timeout_s, should_stop, grace_s, handle.every_s)
        finally:
            end = handle.finish(end)
        assert end is not None  # finish gives an end back for an end
        return end.result(started, datetime.now(UTC), tail.lines())


def follow_unit(
    unit: UnitHandle,
    timeout_s: float,
    should_stop: StopCheck | None,
    grace_s: float,
    every_s: float,
    confirm_s: float = 60.0,
) -> UnitEnd:
    """Follow a started unit to its end, the same way on every backend: stop it past
    `timeout_s` (TIMEOUT) or when `should_stop()` says so (CANCELLED), give a stopped unit
    `grace_s` plus `confirm_s` to say how it ended, and stop it when this process is
    interrupted (then re-raise)."""
    deadline = time.monotonic() + timeout_s
    reason: StopReason | None = None
    give_up = math.inf
    try:
        while True:
            end = unit.poll()
            if end is not None:
                return end.model_copy(update={"stop": reason}) if reason else end
            if reason is None:
                if time.monotonic() >= deadline:
                    reason = StopReason.TIMEOUT
                elif should_stop is not None and should_stop():
                    reason = StopReason.CANCELLED
                if reason is not None:
                    end = unit.stop(reason, grace_s)
                    if end is not None:
                        return end.model_copy(update={"stop": reason})
                    give_up = time.monotonic() + grace_s + confirm_s
                    continue
            elif time.monotonic() > give_up:
                return unit.unconfirmed().model_copy(update={"stop": reason})
            unit.wait(every_s)
    except BaseException:
        # Cancellation, Ctrl-C, SIGTERM from a worker: the unit gets SIGTERM to save state,
        # and its whole grace however many more signals arrive.
        with signals_deferred():
            unit.interrupt(grace_s)
        raise


class ProcessGroupUnit:
    """A unit that is a process group on this machine (started in a session of its own),
    as follow_unit sees it: for backends whose units are local processes."""

    every_s = 0.1

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def poll(self) -> UnitEnd | None:
        code = self.proc.poll()
        return None if code is None else exit_end(code)

    def wait(self, seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=seconds)

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd:
        stop_group(self.proc.pid, None, grace_s)
        return exit_end(self.proc.wait())

    def interrupt(self, grace_s: float) -> None:
        stop_group(self.proc.pid, None, grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)  # reaped: an unreaped child keeps its cgroup busy

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd(signal=9)

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        return end


def exit_end(code: int) -> UnitEnd:
    """Return the end of a process that exited with `code` (negative: killed by a signal)."""
    return UnitEnd(exit_code=code if code >= 0 else None, signal=-code if code < 0 else None)


class Backend(Protocol):
    """Every backend speaks these verbs; each says what it does on retry and when things are gone."""

    name: ClassVar[str]
    # what it can do; a backend whose units do not run here also gives `describe(spec)`
    capabilities: ClassVar[Capabilities]
    # what its `placement:` holds besides the shared fields (registered with the backend)
    placement_model: ClassVar[type[Placement]]
    # the gpuflow extra its client needs in gpuflow's environment (None: the base install)
    extra: ClassVar[str | None]
    # its default prices, in every PriceTable once it is registered
    list_prices: ClassVar[ListPrices]

    @classmethod
    def at(cls, placement: Placement | None = None) -> Self:
        """Return the backend for a spec's placement (its block, namespace); None: defaults.
        Its settings are read once, when first needed, and never change."""

    @classmethod
    def of(cls, cluster: Cluster) -> Self:
        """Return the backend `cluster` was made with, from what its state records."""

    @classmethod
    def block_types(cls) -> list[type]:
        """Return the Prefect block types its settings are saved in."""

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> Self:
        """Return the backend `gpuflow reap --backend NAME` asks: `block` its block (a
        cluster's, a fleet's), `namespace` a Kubernetes namespace; InvalidSpec, naming the
        option, when it needs one that is not given."""

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec with its placement block's settings applied (values written in
        the spec win) and a new price table with the block's (`prices` is left as it is);
        InvalidSpec for a missing block."""

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec if this backend cannot run `spec` (with what its kind `needs`;
        None: nothing beyond the spec); makes nothing. The pipeline matches `needs` with
        `capabilities` itself."""

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """Return the spec with its image pinned by digest (image.digest) where this backend
        resolves images, once every other check passed (pull progress to `say`); one
        sentence (InvalidSpec) for an image that cannot be had, is for another machine or
        lacks a program the kind `needs`."""

    def job_argv(self, cluster: Cluster) -> Callable[[list[str]], list[str]]:
        """Return what turns a command into one that runs on this machine where the
        cluster's units run, in their environment (a container of the run's image, with
        their GPUs): preflight's probes of the job's Python. Backends whose units run
        elsewhere are not asked."""

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return what this backend could give `spec` now, best first, priced with `prices`
        (its block's applied): free GPUs, the queue ahead, $/h. Makes nothing; raises
        InvalidSpec only for settings that are wrong (an unreachable cluster is an offer
        that cannot start, saying why)."""

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        """Return preflight rows saying where and how the job would run (no host checks)."""

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return resources for `spec`. Idempotent: a retry with the same owner adopts what
        exists. Raises CapacityError when nothing is free (retryable), ProvisionError otherwise."""

    def run(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        on_line: LineSink,
        should_stop: StopCheck | None = None,
        grace_s: float = 30.0,
    ) -> JobResult:
        """Run `unit` on its node with `env` (the job's variables: spec env, storage
        credentials, secrets; the backend adds what its nodes need and the unit's own env
        over it) and its GPUs, streaming lines, and return its outcome. On timeout, or
        when `should_stop` says so, the unit is stopped and the result says which. On an
        interruption of this process the unit gets SIGTERM, `grace_s` to save its state,
        then SIGKILL, and the interruption propagates. Several units may run at once."""

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Return where the nodes of `cluster` read `path` (a file on this machine, named by
        its content: job.workdir's archive), putting it there first when they cannot read
        it here; `staging` is the spec's storage.staging."""

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Release everything `cluster` holds. Idempotent: never raises on "already gone"."""

    def outputs_here(self, cluster: Cluster) -> contextlib.AbstractContextManager[Path]:
        """Give the folder on this machine that holds what `cluster`'s job wrote to its
        outputs, for keeping it when a run ends without collect (its gpuflow killed, a
        preemption with no retry left). See UnitBackend.outputs_here."""

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return clusters whose owner labels include `selector`, for a reaper."""

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Remove what runs that are over (or whose gpuflow died) left, asking `runs` how
        each run stands; with `dry_run`, only say what would go. Idempotent."""


@runtime_checkable
class AddsNodes(Protocol):
    """A backend whose runs may claim a node more, and give one back, while they run
    (`Capabilities.adds_nodes`): a fleet, where each is a host's GPUs."""

    def add_node(self, cluster: Cluster, deadline: float, stop: StopCheck | None = None) -> Cluster:
        """Claim one node more for `cluster`'s run, waiting for room (an elastic fleet
        grows for it) until `deadline` (time.time()) or until `stop()` says so; return the
        cluster with it last. CapacityError when no room came in time, JobCancelled when
        `stop` ended the wait."""
        ...

    def drop_node(self, cluster: Cluster, node: int) -> Cluster:
        """Give back `node` of `cluster` (its units ended); return the cluster."""
        ...


@runtime_checkable
class ServesReplicas(Protocol):
    """A backend that keeps a service's replicas itself (`Capabilities.serves_replicas`):
    Kubernetes, a Deployment behind a Service, scaled by a HorizontalPodAutoscaler."""

    def serve(
        self,
        cluster: Cluster,
        app: Replicated,
        env: Mapping[str, str],
        timeout_s: float,
        on_change: Callable[[dict[str, Any]], None],
        should_stop: StopCheck | None,
        grace_s: float,
    ) -> JobResult:
        """Make `app`'s objects, report what changes through `on_change` until `timeout_s`
        passes or `should_stop()` says so, then delete them; return how it ended. On a
        retry it adopts what an earlier try made; objects already gone are no error."""
        ...


def say_in_run(message: str) -> None:
    """Say `message` in the run's log (the Prefect run logger when there is one)."""
    try:
        from prefect import get_run_logger

        get_run_logger().info(message)
    except Exception:
        print(message, flush=True)
