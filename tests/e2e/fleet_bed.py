"""GPU servers for fleet tests (scripts/fleet-testbed.sh): brought up, described, saved as
a GpuFleet block, brought down; an elastic fleet's EC2 instances played as its hosts."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

TESTBED = Path(__file__).resolve().parents[2] / "scripts" / "fleet-testbed.sh"


@contextlib.contextmanager
def fleet_bed(
    folder: Path, hosts: list[str], host_env: dict[str, str] | None = None
) -> Iterator[dict]:
    """Bring up hosts (NAME:GPUS[:PRODUCT][:nopython]) in `folder`, `host_env` added to
    each host's environment; yield their description (hosts.json, the client key, the
    folder); bring them down, whatever happens."""
    extra = " ".join(f"{k}={v}" for k, v in (host_env or {}).items())
    env = {**os.environ, "FLEET_PYTHON": sys.executable, "FLEET_HOST_ENV": extra}
    subprocess.run([str(TESTBED), "up", str(folder), *hosts], check=True, env=env)
    try:
        yield json.loads((folder / "hosts.json").read_text()) | {
            "key": (folder / "client_key").read_text(),
            "dir": folder,
        }
    finally:
        subprocess.run([str(TESTBED), "down", str(folder)], check=True)


def host_entry(bed: dict, host: str, **over) -> dict:
    """Return `host` of the bed as a GpuFleet host entry, with `over` on top."""
    found = next(h for h in bed["hosts"] if h["name"] == host)
    entry = {
        "name": host,
        "address": found["address"],
        "known_hosts": found["known_hosts"],
        "gpus": found["gpus"],
    }
    return entry | over


def save_fleet(bed: dict, name: str, hosts: list[dict], **over) -> None:
    """Save the bed's key as Secret block fleet-test-key and a GpuFleet `name` of `hosts`."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet

    Secret(value=bed["key"]).save("fleet-test-key", overwrite=True)
    GpuFleet(hosts=hosts, ssh_key="fleet-test-key", **over).save(name, overwrite=True)


def claims_on(bed: dict, host: str) -> list[str]:
    """Return the GPU claim files on `host` (its local backend's, under its GPUFLOW_HOME)."""
    folder = Path(bed["dir"]) / host / "gpuflow" / "local" / "gpus"
    return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []


def records_on(bed: dict, host: str) -> list[str]:
    """Return the runs `host` still has a record of."""
    folder = Path(bed["dir"]) / host / "gpuflow" / "local" / "clusters"
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def run_user_data(home: Path, encoded: str, env: dict[str, str]) -> str:
    """Run an instance's user-data (base64, as the cloud keeps it) on its played host
    `home`, as cloud-init would, with `env` (its role's way to credentials) and the places
    the bed's sshd reads keys from; return its console."""
    script = home / "user-data"
    script.write_text(base64.b64decode(encoded).decode())
    done = subprocess.run(
        ["bash", str(script)],
        env={
            "PATH": f"{home / 'bin'}:/usr/bin:/bin",  # the image's python3 (with boto3)
            **env,
            "AUTHORIZED_KEYS": str(home / "authorized_keys"),
            "SSH_HOST_KEY": str(home / "host_key.pub"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


class PlayedFleetInstances:
    """An elastic fleet's EC2 instances (moto's), played as hosts of a test bed: each new
    instance of the fleet becomes, after `boot_s` (a boot's delay), a host at its private
    address (`fleet-testbed.sh add`), its GPUs those of its instance type, and its real
    user-data runs (letting the fleet's key in and publishing its host key, as on EC2). An
    instance moto says is terminated loses its host (`remove`: its power cut)."""

    def __init__(
        self,
        ec2,
        bed: dict,
        products: dict[str, tuple[int, str]],
        profile: dict[str, str],
        boot_s: float = 0,
    ):
        self.ec2, self.bed, self.products, self.boot_s = ec2, bed, products, boot_s
        self.profile = profile  # the instance profile's keys
        self.booted: dict[str, Path] = {}
        self.console: dict[str, str] = {}
        self.errors: list[
            str
        ] = []  # what went wrong booting or powering off (for a test's message)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="played-fleet")

    def __enter__(self) -> PlayedFleetInstances:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(30)

    def _watch(self) -> None:
        seen: dict[str, float] = {}
        while not self.stopping.is_set():
            try:
                states = {}
                owned = [{"Name": "tag:gpuflow.io/owner", "Values": ["gpuflow-fleet"]}]
                for page in self.ec2.get_paginator("describe_instances").paginate(Filters=owned):
                    for reservation in page["Reservations"]:
                        for item in reservation["Instances"]:
                            states[item["InstanceId"]] = item
                for instance_id, item in states.items():
                    alive = item["State"]["Name"] in ("pending", "running")
                    if alive and instance_id not in self.booted:
                        seen.setdefault(instance_id, time.monotonic())
                        if time.monotonic() - seen[instance_id] >= self.boot_s:
                            self._boot(item)
                    elif not alive and instance_id in self.booted:
                        self._power_off(instance_id)
            except Exception as exc:  # said in the test's failure; the next tick tries again
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stopping.wait(0.3)

    def _boot(self, item: dict) -> None:
        instance_id, address = item["InstanceId"], item["PrivateIpAddress"]
        gpus, product = self.products[item["InstanceType"]]
        home = Path(self.bed["dir"]) / instance_id
        self.booted[instance_id] = home  # before `add`: a failed boot is not tried again
        added = subprocess.run(
            [str(TESTBED), "add", str(self.bed["dir"]), f"{instance_id}:{gpus}:{product}", address],
            capture_output=True,
            text=True,
            env={**os.environ, "FLEET_PYTHON": sys.executable},
        )
        if added.returncode != 0:
            raise RuntimeError(f"fleet-testbed add {instance_id}: {added.stderr.strip()}")
        data = self.ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
        self.console[instance_id] = run_user_data(home, data["UserData"]["Value"], self.profile)

    def _power_off(self, instance_id: str) -> None:
        subprocess.run([str(TESTBED), "remove", str(self.bed["dir"]), instance_id], check=True)
        self.booted.pop(instance_id)


class PlayedFleetOnFake:
    """An elastic fleet's instances on a fake cloud (tests/fakes/alibaba_ecs.py,
    tencent_cvm.py), played as hosts of a fleet test bed: each instance the fake launches
    for a fleet gets the next address on the bed's /24 and becomes a host there
    (`fleet-testbed.sh add`, in a thread: the API answers while it boots), its GPUs those
    of its type (`products`); its real user-data runs with the variable `metadata` pointing
    at the fake's metadata service for it (where the role's credentials are), letting the
    fleet's key in and publishing its host key. An instance the fake deletes loses its
    host."""

    def __init__(self, fake, bed: dict, products: dict[str, tuple[int, str]], metadata: str):
        self.fake, self.bed, self.products, self.metadata = fake, bed, products, metadata
        self.net = bed["address"].rsplit(".", 1)[0]
        self.addresses: dict[str, str] = {}
        self.booted: dict[str, Path] = {}
        self.console: dict[str, str] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> PlayedFleetOnFake:
        self.fake.address_of = self._address
        self.fake.on_launch = self._launched
        self.fake.on_delete = self._deleted
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.on_launch = self.fake.on_delete = lambda _i: None
        for thread in self.threads:
            thread.join(120)
        for instance_id in list(self.booted):
            self._power_off(instance_id)

    def _address(self, instance_id: str) -> str:
        with self.lock:
            self.addresses[instance_id] = f"{self.net}.{100 + len(self.addresses)}"
            return self.addresses[instance_id]

    def _launched(self, instance: dict) -> None:
        if instance["Tags"].get("gpuflow.io/owner") != "gpuflow-fleet":
            return
        thread = threading.Thread(target=self._boot, args=(instance,), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _deleted(self, instance: dict) -> None:
        if instance["InstanceId"] in self.booted:
            self._power_off(instance["InstanceId"])

    def _boot(self, instance: dict) -> None:
        instance_id = instance["InstanceId"]
        try:
            gpus, product = self.products[instance["InstanceType"]]
            home = Path(self.bed["dir"]) / instance_id
            added = subprocess.run(
                [str(TESTBED), "add", str(self.bed["dir"]), f"{instance_id}:{gpus}:{product}",
                 self.addresses[instance_id]],
                capture_output=True,
                text=True,
                env={**os.environ, "FLEET_PYTHON": sys.executable},
            )  # fmt: skip
            if added.returncode != 0:
                raise RuntimeError(f"fleet-testbed add {instance_id}: {added.stderr.strip()}")
            self.booted[instance_id] = home
            metadata = {self.metadata: self.fake.metadata_url(instance_id)}
            self.console[instance_id] = run_user_data(home, instance["UserData"], metadata)
        except Exception as exc:  # said in the test's failure
            self.errors.append(f"{instance_id}: {type(exc).__name__}: {exc}")

    def _power_off(self, instance_id: str) -> None:
        subprocess.run([str(TESTBED), "remove", str(self.bed["dir"]), instance_id], check=True)
        self.booted.pop(instance_id, None)
