"""EC2 instances played on this machine: moto's instances booted the way EC2 boots them.

Each new instance tagged as gpuflow's gets its own instance metadata service (AWS's
amazon-ec2-metadata-mock on a loopback port, serving that instance's id and 127.0.0.1 as
its address, IMDSv2 only) and its real user-data, read back from EC2, run as a local
process in a folder of its own (its "disk"), with the variables an instance has (its
instance profile's keys, the metadata endpoint). An instance moto says is terminated has
its processes killed, as its power is cut. `interrupt` serves a spot interruption notice to
one instance and terminates it `warning_s` later, as EC2 does after its warning.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port

QUIET = ["spot", "-d", "86400", "--rebalance-delay-sec", "86400"]  # no notice for a day


class Instance:
    def __init__(self, instance_id: str, folder: Path) -> None:
        self.id, self.folder = instance_id, folder
        self.port = free_port()
        self.mock: subprocess.Popen | None = None
        self.boot: subprocess.Popen | None = None
        self.user_data = ""

    @property
    def imds(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def console(self) -> str:
        path = self.folder / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""


class PlayedInstances:
    def __init__(self, ec2: Any, mock_binary: str, root: Path, aws_env: dict[str, str]) -> None:
        self.ec2, self.binary, self.root, self.aws_env = ec2, mock_binary, root, aws_env
        self.instances: dict[str, Instance] = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="played-ec2")

    def __enter__(self) -> PlayedInstances:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)
        for instance in list(self.instances.values()):
            self._power_off(instance)

    # -- what a test does ----------------------------------------------------------------

    def wait_for(self, count: int, seconds: float = 60) -> list[Instance]:
        """Return the instances booted so far once there are `count` of them."""
        until = time.monotonic() + seconds
        while len(self.instances) < count:
            assert time.monotonic() < until, f"only {len(self.instances)} instance(s) booted"
            time.sleep(0.2)
        return list(self.instances.values())

    def interrupt(self, instance_id: str, warning_s: float) -> None:
        """Serve a spot interruption notice to the instance now; terminate it `warning_s` later."""
        instance = self.instances[instance_id]
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + warning_s))
        self._stop_mock(instance)
        self._start_mock(instance, ["spot", "-a", "terminate", "-d", "0", "-t", when])

        def later() -> None:
            time.sleep(warning_s)
            with contextlib.suppress(Exception):
                self.ec2.terminate_instances(InstanceIds=[instance_id])

        threading.Thread(target=later, daemon=True).start()

    # -- EC2's side ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(Exception):
                self._tick()
            self.stopping.wait(0.3)

    def _tick(self) -> None:
        states: dict[str, str] = {}
        filters = [{"Name": "tag:gpuflow.io/owner", "Values": ["gpuflow"]}]
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                for i in reservation["Instances"]:
                    states[i["InstanceId"]] = i["State"]["Name"]
        for instance_id, state in states.items():
            known = self.instances.get(instance_id)
            if state in ("pending", "running") and known is None:
                self._boot(instance_id)
            elif state not in ("pending", "running") and known is not None:
                self._power_off(known)

    def _boot(self, instance_id: str) -> None:
        folder = self.root / instance_id
        folder.mkdir(parents=True, exist_ok=True)
        instance = Instance(instance_id, folder)
        attribute = self.ec2.describe_instance_attribute(
            InstanceId=instance_id, Attribute="userData"
        )
        instance.user_data = base64.b64decode(attribute["UserData"]["Value"]).decode()
        (folder / "user-data").write_text(instance.user_data)
        self._start_mock(instance, QUIET)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(folder),
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": instance.imds,
            **self.aws_env,  # the instance profile's keys and the endpoint of this "AWS"
        }
        instance.boot = subprocess.Popen(
            ["bash", str(folder / "user-data")],
            cwd=folder,
            env=env,
            stdout=(folder / "console.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with self.lock:
            self.instances[instance_id] = instance

    def _power_off(self, instance: Instance) -> None:
        if instance.boot is not None and instance.boot.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(instance.boot.pid, signal.SIGKILL)
            instance.boot.wait(10)
        self._stop_mock(instance)

    def _start_mock(self, instance: Instance, args: list[str]) -> None:
        config = instance.folder / "aemm.json"
        config.write_text(
            json.dumps(
                {"metadata": {"values": {"instance-id": instance.id, "local-ipv4": "127.0.0.1"}}}
            )
        )
        instance.mock = subprocess.Popen(
            [
                self.binary,
                *args,
                "-c",
                str(config),
                "-I",
                "-n",
                "127.0.0.1",
                "-p",
                str(instance.port),
            ],
            cwd=instance.folder,
            env={"PATH": os.environ["PATH"], "HOME": str(instance.folder)},
            stdout=(instance.folder / "aemm.log").open("a"),
            stderr=subprocess.STDOUT,
        )
        until = time.monotonic() + 30
        while time.monotonic() < until:
            with contextlib.suppress(httpx.HTTPError):
                ask = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
                if httpx.put(f"{instance.imds}/latest/api/token", headers=ask).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"the metadata mock of {instance.id} did not start")

    def _stop_mock(self, instance: Instance) -> None:
        if instance.mock is not None and instance.mock.poll() is None:
            instance.mock.terminate()
            instance.mock.wait(10)
