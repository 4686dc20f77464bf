"""A service while it lives: the endpoint (HAProxy) and the replicas as units of the run,
each replica checked (ready, then alive), the count scaled on what the endpoint and the
GPUs say, every decision an event and a row of the run's artifacts.

Every process is a unit the run's backend starts, so the backend's guarantees hold for
each (its GPUs, its cgroup, teardown and the reaper finding it); a replica that scales
away is stopped through its own stop check, after HAProxy drained it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import http.client
import logging
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import (
    RUN_LABEL,
    JobResult,
    RunOutcome,
    UnitRunner,
    WorkUnit,
)
from gpuflow.tasks.errors import JobCancelled, JobFailed
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES, SampleTail
from gpuflow.tasks.service import proxy, report, rollout
from gpuflow.tasks.service.model import (
    PORT_VARIABLE,
    Probe,
    ServiceJob,
)
from gpuflow.tasks.service.restarts import STABLE_S, Restarts, listening_elsewhere
from gpuflow.tasks.service.scaling import Load, Scaler
from gpuflow.tasks.spec import JobSpec, job_as

logger = logging.getLogger(__name__)
TICK_S = 0.25  # how often the scaler looks (a waiting request wakes it at once)
DRAIN_S = 30.0  # the longest a replica scaled away may finish the requests it holds
KEY_VARIABLE = "GPUFLOW_STREAM_KEY"  # a stream session's key, in its replicas' environment
LATENCIES_KEPT = 20_000  # per replica: enough for its percentiles, bounded


def free_port(host: str) -> int:
    """Return a TCP port free on `host` now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def passes(probe: Probe, address: str, port: int) -> bool:
    """Return True when `probe` passes against address:port."""
    try:
        if probe.path is None:
            with socket.create_connection((address, port), timeout=probe.timeout_s):
                return True
        connection = http.client.HTTPConnection(address, port, timeout=probe.timeout_s)
        try:
            connection.request("GET", probe.path, headers={"User-Agent": "gpuflow-probe"})
            return 200 <= connection.getresponse().status < 400
        finally:
            connection.close()
    except (OSError, http.client.HTTPException):
        return False


@dataclass
class Replica:
    """One replica: its slot (HAProxy server and GPUs), its port, its unit's future."""

    name: str
    slot: int
    gpus: list[int]
    started: float  # time.monotonic()
    command: list[str]  # its version's
    version: int = 1  # the version of the service's job it runs
    port: int = 0
    address: str = ""  # where the endpoint and the checks reach it (once placed)
    host: str = ""
    node: int = 0  # the run's node it runs on (a claim of its own on a fleet)
    held_from: float | None = None  # when it got its GPUs (time.monotonic())
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "starting"  # starting -> ready -> draining -> ended
    ready_at: float | None = None
    ended_at: float | None = None
    why_ended: str = ""
    future: Future[JobResult] | None = None
    latencies: deque[int] = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))
    requests: int = 0
    errors: int = 0
    utils: list[float] = field(default_factory=list)
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=10))

    @property
    def counted(self) -> bool:
        """True while the replica counts toward the service's replicas."""
        return self.state in ("starting", "ready")


class Service:
    """One service's life in this process: call `serve()`."""

    def __init__(
        self, spec: JobSpec, runner: UnitRunner, deadline: float, key: str | None = None
    ) -> None:
        job = job_as(spec, ServiceJob)
        self.job: ServiceJob = job
        self.spec, self.runner, self.deadline = spec, runner, deadline
        cluster = runner.cluster
        self.cluster = cluster
        self.run_id = cluster.owner.get(RUN_LABEL, cluster.name)
        self.address = socket.gethostbyname(cluster.addresses()[0])  # HAProxy takes addresses
        per_replica = job.replica_gpus if job.replica_gpus is not None else spec.resources.gpus
        # on a fleet each replica claims a node of its own as the load says (the run's
        # first goes to the first replica), the endpoint running here in front of them;
        # elsewhere the replicas share the run's node, each on a slot's GPUs
        self.claims = job.replica_claims
        self.spare: list[int] = [0] if self.claims else []
        self.limit = runner.limit  # what ends the service at `deadline`
        if self.claims and runner.limit == "max_cost_usd":
            # the run pays for its replicas' claims as they come and go, not for one claim
            # all along: max_duration bounds its life, and max_cost_usd what the claims
            # have cost, as it serves (_spent_out)
            self.deadline = time.time() + spec.limits.max_duration
            self.limit = "max_duration"
        held = cluster.gpu_indices
        self.slot_gpus = [
            list(range(per_replica))
            if self.claims
            else held[slot * per_replica : (slot + 1) * per_replica]
            for slot in range(job.replicas.max)
        ]
        self.port = job.port or free_port(job.host)
        self.endpoint = f"http://{job.host}:{self.port}"
        self.folder = Path(cluster.workspace) / "endpoint"
        self.replicas: list[Replica] = []
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.ending = threading.Event()
        self.window: deque[tuple[float, proxy.Request]] = deque()
        self.total_requests = 0
        self.total_errors = 0
        self.latencies: deque[int] = deque(maxlen=LATENCIES_KEPT * 4)
        self.last_request: float | None = None
        self.waiting_since: float | None = None
        # GPU utilisation readings by (replica on a fleet, "" here; GPU index)
        self.util: dict[tuple[str, int], deque[tuple[float, float]]] = {}
        self.decisions: list[dict[str, Any]] = []
        self.endpoint_lines: deque[str] = deque(maxlen=20)
        self.started = time.monotonic()
        self.scaler = Scaler(rollout.targets(job))
        self.pool = ThreadPoolExecutor(
            max_workers=3 * job.replicas.max + 2, thread_name_prefix="service"
        )
        self._counter = 0
        self._say = run_logger()
        self.event = report.Events(cluster, spec.name)
        self.version = self._latest = 1  # the job's version replicas start with
        self._previous: tuple[int, ServiceJob] | None = None  # what a failed roll returns to
        self._offer_ns = 0
        self._surge: Replica | None = None
        self.pusher = report.Pusher(self)  # the figures to the run's Pushgateway
        self.restarts = Restarts(job.failures_max)
        self.key = key  # a stream session's key: its replicas admit only who holds it
        self.failure: str | None = None  # why the service fails (replicas that never serve)

    def _submit(self, work: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `work` on the pool in this run's context (its API, its logger)."""
        return self.pool.submit(contextvars.copy_context().run, work, *args)

    # the endpoint ------------------------------------------------------------------

    def _endpoint_line(self, stream: str, line: str) -> None:
        request = proxy.request_of(line)
        now = time.monotonic()
        if request is not None:
            with self.lock:
                self.window.append((now, request))
                self.last_request = now
                self.total_requests += 1
                self.total_errors += request.status >= 500
                if request.total_ms >= 0:
                    self.latencies.append(request.total_ms)
                replica = self._replica_at(request.server)
                if replica is not None:
                    replica.requests += 1
                    replica.errors += request.status >= 500
                    if request.total_ms >= 0:
                        replica.latencies.append(request.total_ms)
            return
        if proxy.WAITING_MARK in line:
            with self.lock:
                self.last_request = now
                if self.waiting_since is None:
                    self.waiting_since = now
            self.wake.set()
            return
        self.endpoint_lines.append(self.runner.redact(line))
        if "[ALERT]" in line and "no server available" not in line:  # at zero: expected
            self._say("warning", f"endpoint: {self.runner.redact(line)}")

    def _replica_at(self, server: str) -> Replica | None:
        for replica in reversed(self.replicas):
            if proxy.server(replica.slot) == server:
                return replica
        return None

    def _start_endpoint(self) -> tuple[proxy.Runtime, Future[JobResult]]:
        job = self.job
        endpoint = proxy.Endpoint(
            host=job.host,
            port=self.port,
            slots=job.replicas.max,
            wait_s=job.request_wait_s,
            server_timeout_s=max(60.0, job.request_wait_s),
            per_server=job.scaling.connections,
        )
        config = proxy.write_files(self.folder, endpoint)
        if self.claims:  # here, in front of the replicas on the fleet's hosts
            future = self._submit(
                proxy.run_here,
                config,
                self._endpoint_line,
                self.runner.stopping,
                self.ending.is_set,
                self.deadline,
            )
        else:  # a unit of the run, beside its replicas
            unit = WorkUnit(
                name="endpoint",
                command=proxy.command(config),
                gpus=[],
                in_image=False,  # the host's HAProxy, in front of replicas in the image
            )
            future = self._submit(
                self.runner.run,
                unit,
                self._endpoint_line,
                {},
                self.deadline,
                self.ending.is_set,
            )
        runtime = proxy.Runtime(self.folder)
        try:
            runtime.wait_up(30.0, lambda: not future.done())
        except proxy.ProxyError:
            self.ending.set()
            said = " ".join(self.endpoint_lines) or "no output"
            runtime.close()
            raise JobFailed(f"the endpoint (HAProxy) did not start: {said}") from None
        return runtime, future

    # replicas ----------------------------------------------------------------------

    def _start_replica(self, runtime: proxy.Runtime, slot: int) -> None:
        self._counter += 1
        replica = Replica(
            name=f"replica-{self._counter}",
            slot=slot,
            gpus=self.slot_gpus[slot],
            started=time.monotonic(),
            command=list(self.job.command),
            version=self.version,
        )
        self.replicas.append(replica)
        replica.future = self._submit(self._run_replica, replica, runtime)

    def _run_replica(self, replica: Replica, runtime: proxy.Runtime) -> JobResult:
        """Place `replica` (on a fleet: claim its node), point its slot at it, check it,
        run it until it ends or is stopped; give its node back after."""
        began = datetime.now(UTC)
        with contextlib.suppress(JobCancelled):  # scaled away, or the service ended, first
            self._place(replica)
        stop = replica.stop
        try:
            if stop.is_set() or self.ending.is_set():  # scaled away while it was placed
                ended = datetime.now(UTC)
                return JobResult(
                    exit_code=None,
                    started_at=began,
                    ended_at=ended,
                    duration_s=0.0,
                    cancelled=True,
                )
            runtime.point(replica.slot, replica.address, replica.port)
            unit = WorkUnit(
                name=replica.name,
                command=replica.command,
                env={PORT_VARIABLE: str(replica.port), "GPUFLOW_REPLICA": replica.name},
                gpus=None if self.claims else replica.gpus,  # a claim: its node's own
                node=replica.node,
            )

            def on_line(stream: str, line: str) -> None:
                said = self.runner.redact(line)
                replica.last_lines.append(said)
                self._say("info", f"[{replica.name}] {said}")

            self._submit(self._watch, replica, runtime)
            return self.runner.run(
                unit,
                on_line,
                {KEY_VARIABLE: self.key} if self.key else {},
                self.deadline,
                lambda: stop.is_set() or self.ending.is_set(),
            )
        finally:
            if self.claims:
                self._give_back(replica)

    def _place(self, replica: Replica) -> None:
        """Give `replica` its node, address and port: the run's node here; on a fleet a
        node of its own (the run's first if spare, else claimed now, the fleet growing
        for it within start_timeout_s). CapacityError when none came."""
        if not self.claims:
            replica.address, replica.host = self.address, self.cluster.hostname
            replica.port, replica.held_from = free_port("127.0.0.1"), replica.started
            return
        with self.lock:
            node = self.spare.pop() if self.spare else None
        if node is None:
            node = self.runner.add_node(
                time.time() + self.job.start_timeout_s,
                lambda: replica.stop.is_set() or self.ending.is_set(),
            )
        cluster = self.runner.cluster
        replica.node, replica.held_from = node, time.monotonic()
        replica.host = cluster.node_names[node] if node < len(cluster.node_names) else ""
        replica.address = socket.gethostbyname(cluster.addresses()[node])
        replica.port = replica_port(self.run_id, int(replica.name.rpartition("-")[2]))
        self._say("info", f"{replica.name} placed on {replica.host or replica.address}")

    def _give_back(self, replica: Replica) -> None:
        """Give back a replica's node once it ended: its GPUs are free for others."""
        if replica.held_from is None:
            return
        replica.ended_at = replica.ended_at or time.monotonic()
        try:
            self.runner.drop_node(replica.node)
        except Exception as exc:  # teardown gives it back in any case
            logger.debug("node %s of %s not given back: %s", replica.node, replica.name, exc)

    def _watch(self, replica: Replica, runtime: proxy.Runtime) -> None:
        """Check `replica` until it ends: ready (then it gets requests), then alive."""
        job = self.job
        failures = 0
        while not replica.stop.is_set() and not self.ending.is_set():
            assert replica.future is not None
            if replica.future.done():
                return
            if replica.state == "starting":
                if passes(job.ready, replica.address, replica.port):
                    self._ready(replica, runtime)
                elif (
                    time.monotonic() - (replica.held_from or replica.started) > job.start_timeout_s
                ):
                    why = f"not ready within start_timeout_s ({job.start_timeout_s:g} s)"
                    if not self.claims:  # its process is on this machine: look where it listens
                        why += listening_elsewhere(replica.name, replica.port)
                    self._failed(replica, why)
                    self._end(replica, runtime, why)
                    return
                replica.stop.wait(job.ready.period_s)
                continue
            if replica.state != "ready":
                return
            probe = job.liveness
            failures = 0 if passes(probe, replica.address, replica.port) else failures + 1
            if failures >= probe.failures:
                self._end(
                    replica,
                    runtime,
                    f"failed its liveness check {failures} times in a row",
                )
                return
            replica.stop.wait(probe.period_s)

    def _ready(self, replica: Replica, runtime: proxy.Runtime) -> None:
        runtime.state(replica.slot, "ready")
        with self.lock:
            replica.state, replica.ready_at = "ready", time.monotonic()
            if self.waiting_since is not None:  # the requests that waited go to it now:
                self.last_request = replica.ready_at  # the quiet before zero starts after
            self.waiting_since = None
        cold = replica.ready_at - replica.started
        self._say("info", f"{replica.name} ready on port {replica.port} after {cold:.1f} s")
        self.event(
            "gpuflow.service.ready",
            {"replica": replica.name, "cold_start_s": round(cold, 2)},
        )

    def _end(self, replica: Replica, runtime: proxy.Runtime, why: str, drain: bool = False) -> None:
        """Take `replica` out of rotation (after its requests, when `drain`) and stop it."""
        with self.lock:
            if not replica.counted:
                return
            replica.state, replica.why_ended = "draining", why
        try:
            if drain:
                runtime.state(replica.slot, "drain")
                until = time.monotonic() + DRAIN_S
                while runtime.sessions(replica.slot) and time.monotonic() < until:
                    time.sleep(0.05)
            runtime.state(replica.slot, "maint")
        except proxy.ProxyError as exc:  # HAProxy gone: the service is ending anyway
            logger.debug("taking %s out: %s", replica.name, exc)
        replica.stop.set()
        if why and not drain:
            self._say("warning", f"{replica.name} replaced: {why}")
            self.event("gpuflow.service.replaced", {"replica": replica.name, "why": why})

    def _reap(self, runtime: proxy.Runtime) -> None:
        """Mark replicas whose unit ended; one that ended by itself is replaced."""
        for replica in self.replicas:
            if replica.state == "ended" or replica.future is None or not replica.future.done():
                continue
            if replica.counted:
                why = self._ended_by_itself(replica)
                if why is None:  # the run's cancel stopped it, as it stops the endpoint
                    replica.why_ended = "the service ended"
                else:
                    ready_at = replica.ready_at
                    if ready_at is None or time.monotonic() - ready_at < STABLE_S:
                        self._failed(replica, why)
                    self._end(replica, runtime, why)
            replica.state, replica.ended_at = "ended", time.monotonic()
        now = time.monotonic()
        if any(r.state == "ready" and now - (r.ready_at or now) >= STABLE_S for r in self.replicas):
            self.restarts.served()
        self.failure = self.failure or self.restarts.given_up()

    def _failed(self, replica: Replica, why: str) -> None:
        """Count `replica` as one that failed to serve; the next waits (said)."""
        with self.lock:
            wait = self.restarts.failed(f"{replica.name} {why}", time.monotonic())
            count = self.restarts.failures
        if count < self.job.failures_max:
            self._say(
                "warning",
                f"{replica.name} failed to serve ({count} of job.failures_max"
                f" {self.job.failures_max} in a row); the next replica starts in {wait:g} s",
            )

    @staticmethod
    def _ended_by_itself(replica: Replica) -> str | None:
        """Return how a replica's unit ended when nothing of gpuflow's stopped it."""
        assert replica.future is not None
        try:
            result = replica.future.result()
        except Exception as exc:  # the backend could not start or follow it
            return f"it could not be started: {exc}"
        if result.cancelled:
            return None
        code = (
            f"exit code {result.exit_code}"
            if result.exit_code is not None
            else f"signal {result.signal}"
        )
        tail = " | ".join(list(replica.last_lines)[-3:])
        return f"its process ended ({code}){': ' + tail if tail else ''}"

    # scaling -----------------------------------------------------------------------

    def _on_sample(self, sample: dict[str, Any], source: str = "") -> None:
        """Keep a GPU sample: of this machine's GPUs, or (`source`: the file a fleet
        host's sampler writes for one unit) of one replica's."""
        now = time.monotonic()
        owner = _unit_of(source)
        with self.lock:
            for gpu in sample.get("gpus", []):
                util = gpu.get("DCGM_FI_DEV_GPU_UTIL")
                if util is not None:
                    self.util.setdefault((owner, int(gpu["gpu"])), deque(maxlen=4096)).append(
                        (now, float(util))
                    )
            for replica in self.replicas:
                if replica.state == "ready" and replica.gpus:
                    values = [self.util[k][-1][1] for k in self._gpus_of(replica)]
                    if values:
                        replica.utils.append(statistics.fmean(values))

    def _gpus_of(self, replica: Replica) -> list[tuple[str, int]]:
        """Return the keys of `replica`'s GPU readings."""
        if self.claims:
            return [key for key in self.util if key[0] == replica.name]
        return [("", g) for g in replica.gpus if ("", g) in self.util]

    def _load(self, now: float, connections: int = 0) -> Load:
        window = self.job.scaling.window_s
        with self.lock:
            while self.window and self.window[0][0] < now - window:
                self.window.popleft()
            span = min(window, max(now - self.started, 1.0))
            ready = [r for r in self.replicas if r.state == "ready"]
            keys = [k for r in ready for k in self._gpus_of(r)]
            readings = [u for k in keys for t, u in self.util.get(k, ()) if t >= now - window]
            return Load(
                t=now,
                replicas=sum(r.counted for r in self.replicas),
                ready=len(ready),
                rps=len(self.window) / span,
                gpu_util=statistics.fmean(readings) if readings else None,
                waiting=self.waiting_since is not None and not ready,
                last_request_t=self.last_request,
                connections=connections,
            )

    def _scale(self, runtime: proxy.Runtime) -> None:
        try:  # connections open now (a WebSocket, a long request) are not quiet
            sessions = {name: int(row.get("scur") or 0) for name, row in runtime.stats().items()}
            open_now = sum(sessions.values()) + runtime.queued()
        except (proxy.ProxyError, ValueError):
            sessions, open_now = {}, 0
        if open_now:
            with self.lock:
                self.last_request = time.monotonic()
        load = self._load(time.monotonic(), open_now)
        need = self.scaler.decide(load)
        if need.replicas == load.replicas:
            return
        if need.replicas > load.replicas:
            if not self.restarts.may_start(time.monotonic()):
                return  # backing off after replicas that failed to serve
            taken = {r.slot for r in self.replicas if r.state != "ended"}
            free = [slot for slot in range(self.job.replicas.max) if slot not in taken]
            if not free:
                return  # every slot still drains a replica: the next look starts them
            wanted = min(need.replicas, load.replicas + len(free))
            self._decided(load, wanted, need.why)
            for slot in free[: wanted - load.replicas]:
                self._start_replica(runtime, slot)
            return
        if any(r.version != self.version for r in self.replicas if r.counted):
            return  # a roll holds one replica more than the need until it is done
        self._decided(load, need.replicas, need.why)
        counted = [r for r in self.replicas if r.counted]
        # idle replicas go first (a client's connection stays), not-yet-ready ones first
        counted.sort(
            key=lambda r: (
                sessions.get(proxy.server(r.slot), 0),
                r.state == "ready",
                r.started,
            )
        )
        for replica in counted[: load.replicas - need.replicas]:
            self._submit(self._end, replica, runtime, "scaled down", True)

    def _decided(self, load: Load, wanted: int, why: str) -> None:
        row = {
            "at_s": round(load.t - self.started, 1),
            "from": load.replicas,
            "to": wanted,
            "why": why,
            "requests_per_s": round(load.rps, 2),
            "gpu_util": None if load.gpu_util is None else round(load.gpu_util, 1),
        }
        self.decisions.append(row)
        self._say("info", f"replicas {load.replicas} -> {wanted}: {why}")
        self.event("gpuflow.service.scaled", row)
        report.table(
            f"service-{slug(self.spec.name)}-scaling",
            self.decisions[-200:],
            "scaling decisions",
        )

    # new versions ------------------------------------------------------------------

    # the life ----------------------------------------------------------------------

    def serve(self) -> RunOutcome:
        """Serve until the run is cancelled or its deadline; return the outcome."""
        began = datetime.now(UTC)
        runtime, endpoint = self._start_endpoint()
        self._say(
            "info",
            f"endpoint {self.endpoint} (HAProxy), replicas {self.job.replicas.min}-{self.job.replicas.max};"
            f" {reachable_by(self.job.host)}",
        )
        if self.key:
            self._say(
                "info",
                f"open {self.endpoint}/?key={self.key} (the session's key: whoever holds this"
                " address watches and drives the session; nobody else gets in)",
            )
        report.markdown(
            f"service-{slug(self.spec.name)}",
            f"# {self.spec.name}\n\nendpoint: `{self.endpoint}`\n\nreplicas: {self.job.replicas.min}"
            f" to {self.job.replicas.max}",
        )
        self.event("gpuflow.service.started", {"endpoint": self.endpoint})
        if self.claims:  # each replica's host writes its samples here as they come
            tail = SampleTail(
                Path(self.cluster.workspace),
                NODE_SAMPLES,
                self._on_sample,
                0.5,
                named=True,
            )
            if self.job.replicas.min == 0:  # nothing serves yet: the run's node goes back
                self.spare.clear()
                self.runner.drop_node(0)
        else:
            tail = SampleTail(Path(self.cluster.workspace), SAMPLES, self._on_sample, 0.5)
        limited = False
        try:
            with tail:
                while not endpoint.done() and time.time() < self.deadline:
                    if report.spent_out(self):
                        self.limit = "max_cost_usd"
                        break
                    try:
                        self._reap(runtime)
                        if self.failure is not None:
                            self._say("error", f"the service fails: {self.failure}")
                            break
                        rollout.take_offer(self)
                        rollout.roll(self, runtime)
                        self._scale(runtime)
                        self.pusher.push()
                    except proxy.ProxyError as exc:  # HAProxy went away: its unit says why
                        logger.debug("the endpoint did not answer: %s", exc)
                    self.wake.wait(TICK_S)
                    self.wake.clear()
                # the deadline came with the endpoint still up: the limit ends the service
                # (its unit, stopped next, may say cancelled: it is stopped by us)
                limited = not endpoint.done()
                if limited:
                    self._say("info", f"limits.{self.limit} reached: the service ends")
        finally:
            self.ending.set()
            for replica in self.replicas:
                replica.stop.set()
            self.pool.shutdown(wait=True)
            runtime.close()
            for replica in self.replicas:
                if replica.counted or replica.state == "draining":
                    replica.state, replica.ended_at = "ended", time.monotonic()
                    replica.why_ended = replica.why_ended or "the service ended"
        return report.outcome(self, began, endpoint.result(), limited)


def serve(spec: JobSpec, runner: UnitRunner, deadline: float, key: str | None = None) -> RunOutcome:
    """Run the service of `spec` through `runner` until `deadline` or cancellation; with
    `key`, each replica gets it ($GPUFLOW_STREAM_KEY, never in its command line) and the
    page's address the run says carries it."""
    return Service(spec, runner, deadline, key).serve()


def reachable_by(host: str) -> str:
    """Return who reaches an endpoint listening on `host`, and how to narrow it."""
    if host in ("0.0.0.0", "::"):
        return (
            "every machine that reaches this one can call it (job.host 127.0.0.1 keeps it"
            " to this machine; the endpoint asks no credential: the serving program's own)"
        )
    if host.startswith("127.") or host in ("::1", "localhost"):
        return (
            "every user of this machine can call it, nobody else (the endpoint asks no"
            " credential: check one in the serving program if others share the machine)"
        )
    return f"whoever reaches {host} can call it (job.host 127.0.0.1 keeps it to this machine)"


def replica_port(run_id: str, counter: int) -> int:
    """Return the port replica `counter` of run `run_id` listens on, on a host that many
    runs share (12000-19999, below the runs' rendezvous ports and the ephemeral ones): a
    replica that finds it taken fails its start and is replaced on the next."""
    base = int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16)
    return 12000 + (base + counter) % 8000


def _unit_of(source: str) -> str:
    """Return the replica a fleet host's sample file is of ("" for this machine's)."""
    if not source:
        return ""
    stem = source.removeprefix(NODE_SAMPLES.split("*")[0]).removesuffix(NODE_SAMPLES.split("*")[1])
    return stem.rpartition("-")[0]  # the unit's id: NAME-XXXXXX


def slug(name: str) -> str:
    """Return `name` as an artifact key's part: lowercase letters, digits and dashes."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "service"


def run_logger() -> Callable[[str, str], None]:
    """Return say(level, message): the run's logger, or this module's outside a run."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        run_logger = get_run_logger()
    except MissingContextError:
        run_logger = logging.getLogger("gpuflow.service")

    def say(level: str, message: str) -> None:
        getattr(run_logger, level)("%s", message)

    return say
