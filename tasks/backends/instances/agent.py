"""gpuflow's agent on a rented instance, the same on every cloud: started by the instance's
user-data, it pulls the run's work from its mailbox in object storage
(gpuflow.tasks.backends.instances.mailbox) and answers there. Each provider starts it with
what is its cloud's (`NodeCloud`: the metadata service, object storage, the run's secret,
terminating its own instance):

    python -m gpuflow.tasks.backends.ec2.agent --config <base64 JSON, no secrets in it>

What it does, in one loop:
- says it is ready (address, GPUs, CPUs) and runs each unit written for its instance, in
  a process group of its own, with the run's variables read from the run's secret; output
  lines go to the mailbox in batches, output files and the result after the unit ends;
- stops a unit (SIGTERM, the grace, SIGKILL) when the orchestrator asks;
- polls the spot interruption notice (and EC2's rebalance recommendation) every 5 s:
  on an interruption notice every unit gets SIGTERM at once (training checkpoints and
  exits 75) and the notice is written for the orchestrator;
- terminates its own instance when the orchestrator's heartbeat has not changed for
  `orphan_after_s`, or when `deadline_s` (the job's max_duration plus grace) has passed,
  after stopping its units, even if nothing else is alive;
- tells the run's Prefect log (the API named in its config, with the token from the run's
  secret) that it started, what it saw and why it ends itself.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from gpuflow.tasks import containers, nvml
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.instances.mailbox import (
    HEARTBEAT,
    Mailbox,
    log_key,
    s3_compatible,
    unit_key,
)
from gpuflow.tasks.backends.instances.notices import Metadata, Notice, NoticeWatcher
from gpuflow.tasks.contract import unit_env
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import OutputPump, stop_group
from gpuflow.tasks.metrics.prometheus import LivePush
from gpuflow.tasks.metrics.sampler import Sampler
from gpuflow.tasks.spec import Image

PYTHON = "{python}"  # a unit's command naming gpuflow's interpreter: the agent's own
OUTPUT_MAX_BYTES = 8 * 1024 * 1024
OUTPUT_MAX_FILES = 500
FLUSH_S = 1.0
HEARTBEAT_READ_S = 5.0


class AgentConfig(BaseModel):
    """The agent's settings, as user-data passes them: nothing secret."""

    run_id: str
    control: str  # s3:// prefix of the mailboxes
    region: str
    endpoint_url: str | None = None  # AWS endpoint (S3, EC2, Secrets Manager) when not AWS's
    secret_id: str  # where the Prefect API key and the run's variables are kept
    # a provider's own settings (its API's and object storage's endpoints), nothing secret
    cloud: dict[str, str] = {}
    orphan_after_s: float = 900.0
    deadline_s: float = 24 * 3600.0
    prefect_api_url: str | None = None
    workspace: str = "~/gpuflow-work"
    poll_s: float = 1.0
    notice_every_s: float = 5.0

    def encode(self) -> str:
        return base64.b64encode(self.model_dump_json().encode()).decode()


class UnitSpec(BaseModel):
    """What the orchestrator asks an agent to run (unit.json)."""

    name: str
    command: list[str]
    env: dict[str, str] = {}
    gpus: list[int] | None = None
    node: int = 0
    nodes: int = 1  # how many nodes the run has
    timeout_s: float
    # sample this node's GPUs while it runs: interval_s, and pushgateway / push_interval_s
    # / job when the run pushes live metrics
    metrics: dict[str, Any] | None = None
    image: dict[str, Any] | None = None  # the run's pinned image: the unit runs in it
    cluster: str = ""  # the run's cluster, on its containers' label


def now() -> str:
    return datetime.now(UTC).isoformat()


class NodeCloud(Protocol):
    """What the agent needs of its instance's cloud."""

    @property
    def metadata(self) -> Metadata:
        """The instance's metadata service: its id and address, and its notices."""
        ...

    def storage(self) -> Any:
        """A boto3 S3 client of the cloud's object storage, as the instance's role reaches it."""
        ...

    def read_secret(self, secret_id: str) -> str:
        """The run's secret (JSON), as the instance's role reads it."""
        ...

    def terminate(self, instance_id: str) -> None:
        """Terminate this instance through the cloud's API (raises when refused)."""
        ...

    def unit_env(self) -> dict[str, str]:
        """What a unit's environment gets to reach the cloud's object storage as the
        instance does (s3:// in the job, the run's staged files): the role's keys where no
        SDK on the instance finds them by itself."""
        ...


class Agent:
    def __init__(self, config: AgentConfig, cloud: NodeCloud) -> None:
        self.config, self.cloud = config, cloud
        self.imds = cloud.metadata
        self.instance_id = self.imds.instance_id()
        self.mailbox = Mailbox(cloud.storage(), config.control, config.run_id)
        self.workspace = Path(os.path.expanduser(config.workspace))
        self.units: dict[str, UnitRun] = {}
        self.lock = threading.Lock()
        self.interrupted: Notice | None = None
        self.api_key: str | None = None
        self.env: dict[str, str] = {}
        self.login: tuple[str | None, str | None] = (None, None)
        self.images: dict[str, imaging.HostImage] = {}  # pulled here, by pinned reference

    # -- what the run hears ------------------------------------------------------------

    def say(self, message: str, level: int = 20) -> None:
        """Print `message` (the instance's console) and send it to the run's Prefect log."""
        line = f"agent on {self.instance_id}: {message}"
        print(line, flush=True)
        if not self.config.prefect_api_url:
            return
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        record = {
            "name": "gpuflow.ec2.agent",
            "level": level,
            "message": line,
            "timestamp": now(),
            "flow_run_id": self.config.run_id,
        }
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{self.config.prefect_api_url.rstrip('/')}/logs/",
                json=[record],
                headers=headers,
                timeout=5,
            )

    def _read_secret(self) -> None:
        secret = json.loads(self.cloud.read_secret(self.config.secret_id))
        self.api_key = secret.get("prefect_api_key") or None
        self.env = dict(secret.get("env") or {})
        login = secret.get("registry_login") or {}
        self.login = (login.get("username"), login.get("password"))

    def host_image(self, given: dict[str, Any]) -> imaging.HostImage:
        """The run's image on this instance: pulled by its digest once (the run's login),
        checked for this machine; InvalidSpec (one sentence) when it cannot be had."""
        image = Image.model_validate(given)
        with self.lock:
            found = self.images.get(image.pinned)
        if found is not None:
            return found
        engine = containers.find_engine()
        self.say(f"pulling {image.pinned} with {engine.name}")
        pinned = containers.pull(engine, image.pinned, lambda _line: None, self.login, image.pull)
        containers.check_architecture(pinned)
        found = imaging.HostImage(
            engine=engine.name,
            engine_path=engine.path,
            image_id=pinned.image_id,
            shown=pinned.pinned_ref,
            user=containers.user_of(image.user),
        )
        with self.lock:
            self.images[image.pinned] = found
        return found

    # -- the loop ----------------------------------------------------------------------

    def serve(self) -> int:
        self.workspace.mkdir(parents=True, exist_ok=True)
        (self.workspace / "outputs").mkdir(exist_ok=True)
        self._read_secret()
        address = self.imds.address() or socket.gethostbyname(socket.gethostname())
        self.mailbox.put_json(
            f"nodes/{self.instance_id}/ready",
            {
                "instance_id": self.instance_id,
                "address": address,
                "gpus": gpu_count(),
                "cpus": os.cpu_count() or 1,
                "at": now(),
            },
        )
        self.say(f"ready at {address}; {gpu_count()} GPU(s)")
        started = time.monotonic()
        beat, beat_changed, beat_read = None, time.monotonic(), 0.0
        trouble: str | None = None
        watcher = NoticeWatcher(
            self.imds, self._notice, self.config.notice_every_s, lambda why: self.say(why, 30)
        )
        with watcher:
            while True:  # until it ends its instance (end_self returns)
                if time.monotonic() - beat_read >= HEARTBEAT_READ_S:
                    beat_read = time.monotonic()
                    with contextlib.suppress(Exception):  # S3 away: the clock runs on
                        seen = self.mailbox.get(HEARTBEAT)
                        if seen != beat:
                            beat, beat_changed = seen, time.monotonic()
                silent = time.monotonic() - beat_changed
                if silent > self.config.orphan_after_s:
                    return self.end_self(
                        f"the orchestrator's heartbeat has not changed for {silent:.0f} s"
                        f" (limits.orphan_after {self.config.orphan_after_s:.0f} s)"
                    )
                if time.monotonic() - started > self.config.deadline_s:
                    return self.end_self(
                        f"the job's time is up (limits.max_duration plus grace,"
                        f" {self.config.deadline_s:.0f} s)"
                    )
                try:
                    self._take_units()
                    trouble = None
                except Exception as exc:  # S3 away for a moment: said once, tried again
                    if trouble != type(exc).__name__:
                        self.say(f"could not read the mailbox ({type(exc).__name__}: {exc})", 30)
                    trouble = type(exc).__name__
                time.sleep(self.config.poll_s)

    def _take_units(self) -> None:
        under = f"nodes/{self.instance_id}/units/"
        for key in self.mailbox.keys(under):
            name, _, leaf = key[len(under) :].partition("/")
            unit = self.units.get(name)
            if leaf == "unit.json" and unit is None:  # each try of a unit has its own name
                spec = UnitSpec.model_validate(self.mailbox.get_json(key))
                if self.mailbox.get(unit_key(self.instance_id, name, "result.json")):
                    self.units[name] = UnitRun(self, spec)  # ended before this agent
                    continue
                self._read_secret()  # the run's variables as they are now
                self.units[name] = run = UnitRun(self, spec)
                run.start()
            elif leaf == "stop" and unit is not None and unit.alive():
                ask = self.mailbox.get_json(key) or {}
                unit.stop(str(ask.get("why", "asked")), float(ask.get("grace_s", 30)))

    def _notice(self, notice: Notice) -> None:
        if notice.kind == "rebalance":
            self.say(
                f"rebalance recommendation at {notice.at:%H:%M:%S}: an interruption may follow"
            )
            return
        self.interrupted = notice
        self.mailbox.put_json(
            f"notices/{self.instance_id}",
            {
                "kind": notice.kind,
                "at": notice.at.isoformat(),
                "seen_at": notice.seen_at.isoformat(),
            },
        )
        self.say(
            f"spot interruption notice ({notice.kind} at {notice.at:%H:%M:%S}): stopping the"
            " job so it saves its state",
            30,
        )
        for unit in list(self.units.values()):
            if unit.alive():
                unit.stop("spot interruption", grace_s=90.0)

    def end_self(self, why: str) -> int:
        """Stop every unit, then terminate this instance (the cloud's API; `shutdown` when
        that is refused: the instance terminates, or stops, on shutdown)."""
        self.say(f"terminating this instance: {why}", 40)
        for unit in list(self.units.values()):
            if unit.alive():
                unit.stop(why, grace_s=30.0)
        for unit in list(self.units.values()):
            unit.join(45.0)
        with contextlib.suppress(Exception):
            self.mailbox.put_json(f"gone/{self.instance_id}", {"why": why, "at": now()})
        try:
            self.cloud.terminate(self.instance_id)
        except Exception as exc:
            self.say(f"the cloud refused to terminate it ({type(exc).__name__}); shutting down", 40)
            subprocess.run(["sudo", "-n", "shutdown", "-h", "now"], check=False)
        return 3


class UnitRun:
    """One unit on this instance: its process, its lines, its ending."""

    def __init__(self, agent: Agent, spec: UnitSpec) -> None:
        self.agent, self.spec = agent, spec
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.lines: list[list[str]] = []
        self.lines_lock = threading.Lock()
        self.seq = 0
        self.stopped_why: str | None = None
        self.container: tuple[imaging.HostImage, str] | None = None

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True, name=self.spec.name)
        self.thread.start()

    def stop(self, why: str, grace_s: float) -> None:
        if self.stopped_why is not None or self.proc is None:
            return
        self.stopped_why = why
        proc = self.proc
        if self.container is not None:  # through its engine: SIGTERM, the grace, removed
            image, name = self.container
            threading.Thread(
                target=imaging.stop, args=(proc, image, name, grace_s), daemon=True
            ).start()
            return

        # SIGTERM, the grace, SIGKILL, while the unit's own thread reaps it
        threading.Thread(target=stop_group, args=(proc.pid, None, grace_s), daemon=True).start()

    def _env(self) -> dict[str, str]:
        workspace = self.agent.workspace
        env = {
            **os.environ,
            **self.agent.env,
            **self.spec.env,
            **unit_env(self.spec.node, self.spec.nodes, str(workspace), self.spec.gpus),
            **self.agent.cloud.unit_env(),
            "PYTHONUNBUFFERED": "1",
        }
        if self.agent.config.endpoint_url:  # the fleet's S3 (the run's staged files) as here
            env.setdefault("AWS_ENDPOINT_URL_S3", self.agent.config.endpoint_url)
        return env

    def _run(self) -> None:
        agent, spec = self.agent, self.spec
        command = [sys.executable if c == PYTHON else c for c in spec.command]
        started = now()
        self.agent.say(f"unit {spec.name} starting")
        try:
            self.proc = self._start_in_image(command) if spec.image else self._start(command)
        except InvalidSpec as exc:  # the image cannot be had here
            self._add("stderr", f"gpuflow: {exc}")
            self._flush()
            self._finish(started, 2, None)
            return
        except OSError as exc:
            self._add("stderr", f"could not start {command[0]}: {exc}")
            self._flush()
            self._finish(started, 127, None)
            return
        if agent.interrupted is not None:  # started after the notice: stop it at once
            self.stop("spot interruption", 90.0)
        pump = OutputPump({"stdout": self.proc.stdout, "stderr": self.proc.stderr}, self._add)
        pump.start()
        timer = threading.Timer(spec.timeout_s, self.stop, args=("timeout", 30.0))
        timer.daemon = True
        timer.start()
        with self._sampling():
            while self.proc.poll() is None:
                time.sleep(FLUSH_S)
                self._flush()
        timer.cancel()
        if held := pump.finish():  # a process the unit left running is not waited on
            self._add(
                "stderr", f"a process the job left running holds its {' and '.join(held)} open"
            )
        self._flush()
        code = self.proc.returncode
        self._finish(started, code if code >= 0 else None, -code if code < 0 else None)

    def _start(self, command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            command,
            cwd=self.agent.workspace,
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _start_in_image(self, command: list[str]) -> subprocess.Popen:
        """The unit in a container of the run's image: the instance's GPUs it was given,
        the workspace at its own path, the run's variables by name."""
        agent, spec = self.agent, self.spec
        assert spec.image is not None
        image = agent.host_image(spec.image)
        gpus = spec.gpus if spec.gpus is not None else list(range(gpu_count()))
        tmp = agent.workspace / ".tmp"
        tmp.mkdir(mode=0o700, exist_ok=True)
        place = imaging.UnitPlace(str(agent.workspace), str(tmp), spec.node, spec.nodes)
        env = {**agent.env, **spec.env, **agent.cloud.unit_env(), "PYTHONUNBUFFERED": "1"}
        if agent.config.endpoint_url:
            env.setdefault("AWS_ENDPOINT_URL_S3", agent.config.endpoint_url)
        cluster = spec.cluster or f"gpuflow-{agent.config.run_id}"
        proc, name = imaging.start(image, cluster, place, spec.name, command, env, gpus)
        self.container = (image, name)
        return proc

    def _samples(self) -> Path:
        return self.agent.workspace / f".gpuflow-samples-{self.spec.name}.jsonl"

    @contextlib.contextmanager
    def _sampling(self) -> Any:
        """Sample this node's GPUs and host while the unit runs (pushing them live when the
        run names a Pushgateway); the samples go to the mailbox when it ends."""
        metrics = self.spec.metrics
        if not metrics:
            yield
            return

        live = None
        if metrics.get("pushgateway"):
            live = LivePush(
                metrics["pushgateway"],
                self.agent.config.run_id,
                str(metrics.get("job", "gpuflow")),
                float(metrics.get("push_interval_s", 15.0)),
                lambda text, *args: self.agent.say(text % args, 30),
            )
        gpus = self.spec.gpus if self.spec.gpus is not None else list(range(gpu_count()))
        with Sampler(self._samples(), gpus, float(metrics.get("interval_s", 1.0)), on_sample=live):
            yield

    def _add(self, stream: str, line: str) -> None:
        with self.lines_lock:
            self.lines.append([stream, line])

    def _flush(self) -> None:
        with self.lines_lock:
            batch, self.lines = self.lines, []
        if not batch:
            return
        self.seq += 1
        key = log_key(self.agent.instance_id, self.spec.name, self.seq)
        with contextlib.suppress(Exception):
            self.agent.mailbox.put(key, "\n".join(json.dumps(line) for line in batch))

    def _finish(self, started: str, code: int | None, sig: int | None) -> None:
        agent = self.agent
        outputs = agent.workspace / "outputs"
        files = sorted(p for p in outputs.rglob("*") if p.is_file())[:OUTPUT_MAX_FILES]
        for path in files:
            if path.stat().st_size <= OUTPUT_MAX_BYTES:
                relative = path.relative_to(outputs).as_posix()
                key = unit_key(agent.instance_id, self.spec.name, f"outputs/{relative}")
                with contextlib.suppress(Exception):
                    agent.mailbox.put(key, path.read_bytes())
        samples = self._samples()
        if samples.is_file():
            with contextlib.suppress(Exception):
                agent.mailbox.put(
                    unit_key(agent.instance_id, self.spec.name, "samples.jsonl"),
                    samples.read_bytes(),
                )
        result = {
            "exit_code": code,
            "signal": sig,
            "started_at": started,
            "ended_at": now(),
            "stopped": self.stopped_why,
            "interrupted": agent.interrupted is not None,
        }
        agent.mailbox.put_json(unit_key(agent.instance_id, self.spec.name, "result.json"), result)
        agent.say(f"unit {self.spec.name} ended: exit {code if sig is None else f'signal {sig}'}")


def gpu_count() -> int:
    """Return how many GPUs NVML sees here (0 without a driver)."""
    try:
        return len(nvml.query().gpus)
    except Exception:
        return 0


def main(argv: list[str] | None, module: str, cloud: Callable[[AgentConfig], NodeCloud]) -> int:
    """The agent of `module` (`python -m module --config ...`), on the cloud `cloud` makes."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--config", required=True, help="base64 of the agent's JSON settings")
    args = parser.parse_args(argv)
    config = AgentConfig.model_validate_json(base64.b64decode(args.config))
    try:
        agent = Agent(config, cloud(config))
    except Exception as exc:
        print(f"gpuflow agent: could not start ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    return agent.serve()


class RoleNode:
    """A NodeCloud for a cloud whose instances reach their role's temporary credentials
    through the metadata service (Alibaba Cloud's RAM role, Tencent Cloud's CAM role):
    object storage through its S3-compatible API with them, the run's secret an object of
    its mailbox, the units given them as AWS_* variables. A provider says how its
    metadata gives the keys (`role_keys`) and how its API ends the instance."""

    RENEW_BEFORE_S = 600  # the role's credentials are asked again this long before expiry

    def __init__(self, config: AgentConfig, metadata: Metadata) -> None:
        self.config, self.metadata = config, metadata
        self.lock = threading.Lock()
        self.keys: tuple[str, str, str | None] | None = None
        self.until = 0.0
        self.s3: Any = None

    def role_keys(self) -> tuple[str, str, str | None]:
        """The role's key id, secret and token, read from the metadata service."""
        raise NotImplementedError

    def terminate(self, instance_id: str) -> None:
        raise NotImplementedError

    def signing_region(self) -> str:
        return self.config.cloud.get("storage_region") or self.config.region

    def current_keys(self) -> tuple[str, str, str | None]:
        with self.lock:
            if self.keys is None or time.monotonic() > self.until:
                self.keys = self.role_keys()
                self.until = time.monotonic() + 3600 - self.RENEW_BEFORE_S
                self.s3 = None
            return self.keys

    def storage(self) -> Any:
        keys = self.current_keys()
        if self.s3 is None:
            self.s3 = s3_compatible(self.config.endpoint_url or "", self.signing_region(), keys)
        return self.s3

    def read_secret(self, secret_id: str) -> str:
        bucket, _, key = secret_id.removeprefix("s3://").partition("/")
        return str(self.storage().get_object(Bucket=bucket, Key=key)["Body"].read().decode())

    def unit_env(self) -> dict[str, str]:
        key, secret, token = self.current_keys()
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": self.signing_region(),
        }
        if token:
            env["AWS_SESSION_TOKEN"] = token
        return env
