"""Services without a server: the spec's bad inputs (one sentence each, before anything
is made), the scaler's decisions as a table, HAProxy's request lines."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_pool
from gpuflow.tasks.service.proxy import Endpoint, Request, config, request_of
from gpuflow.tasks.service.scaling import Load, Need, Scaler, Targets, need_now
from gpuflow.tasks.spec import load_spec


def spec(resources=None, **job):
    return {
        "name": "svc",
        "job": {"kind": "service", "command": [sys.executable, "-m", "http.server"], **job},
        "resources": resources or {"gpus": 1},
    }


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ({"port": 0}, "job.port: 0 is not a TCP port; give one from 1 to 65535, or none"),
        (
            {"command": []},
            "job.command: is empty; give the program to run, e.g. [python, serve.py]",
        ),
        ({"command": "serve | tee log"}, "job.command: holds the shell syntax '|'"),
        ({"port": 70000}, "job.port: 70000 is not a TCP port; give one from 1 to 65535"),
        (
            {"replicas": {"min": 3, "max": 2}},
            "job.replicas: min (3) is above max (2); lower min or raise max",
        ),
        (
            {"scaling": {"gpu_util": 0}},
            "job.scaling.gpu_util: a utilisation target of 0 % can never be met",
        ),
        (
            {"scaling": {"gpu_util": 120}},
            "job.scaling.gpu_util: 120 % is above 100, what a GPU can be busy",
        ),
        (
            {"ready": {"path": "health"}},
            "job.ready.path: 'health' is not a path; start it with /, e.g. /health",
        ),
        ({"live": {"path": "x/y"}}, "job.live.path: 'x/y' is not a path; start it with /"),
        ({"copies": "per_gpu"}, "job.copies: a service runs replicas of its command"),
        ({"launcher": "torchrun"}, "job.launcher: each replica of a service is one process"),
        (
            {"replicas": {"min": 1, "max": 2}, "scaling": {"to_zero_after_s": 60}},
            "job.scaling.to_zero_after_s: ends the last replica, but replicas.min is 1",
        ),
    ],
)
def test_a_bad_service_is_one_sentence(job, said):
    with pytest.raises(InvalidSpec) as caught:
        load_spec(spec(**job))
    assert said in str(caught.value)
    assert "\n" not in str(caught.value) and "Traceback" not in str(caught.value)


def test_gpu_scaling_without_gpus_is_refused_before_anything_is_made(gpuflow_home):
    raw = spec(resources={"gpus": 0, "allow_cpu": True}, scaling={"gpu_util": 70})
    with pytest.raises(InvalidSpec) as caught:
        check_pool(load_spec(raw))
    assert str(caught.value).startswith(
        "job.scaling.gpu_util: scales on the replicas' GPU utilisation, but resources.gpus is 0"
    )
    assert not list((gpuflow_home / "workspaces").glob("*"))  # nothing made


def test_a_port_in_use_is_refused_before_anything_is_made(gpuflow_home):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidSpec) as caught:
            check_pool(load_spec(spec(resources={"gpus": 0, "allow_cpu": True}, port=port)))
    assert str(caught.value).startswith(f"job.port: 127.0.0.1:{port} is in use on this machine")


def test_the_cluster_holds_room_for_the_most_replicas(gpuflow_home, fake_nvml):
    fake_nvml.config["gpus"] = 4
    [(placed, _)] = check_pool(load_spec(spec(replicas={"min": 0, "max": 4})))
    assert placed.resources.gpus == 4 and placed.job.replica_gpus == 1
    [(again, _)] = check_pool(placed)  # a retried attempt: sized once
    assert again.resources.gpus == 4


def test_a_backend_that_neither_runs_here_nor_keeps_replicas_is_refused():
    from gpuflow.tasks.backends.slurm.backend import SlurmBackend
    from gpuflow.tasks.kinds.registry import get_kind

    raw = spec() | {"placement": {"backend": "slurm"}}
    with pytest.raises(InvalidSpec) as caught:
        get_kind("service").check(load_spec(raw), SlurmBackend.capabilities)
    assert str(caught.value).startswith(
        "placement.backend: services run on this machine (local), on a fleet (an elastic one"
        " grows on EC2) and on Kubernetes; slurm cannot serve one"
    )


T = Targets(least=1, most=4, rps=10.0, down_after_s=30.0)


def load(t=0.0, replicas=1, ready=1, rps=0.0, util=None, waiting=False, last=None) -> Load:
    return Load(t, replicas, ready, rps, util, waiting, last)


@pytest.mark.parametrize(
    ("targets", "now", "want"),
    [
        (T, load(rps=25.0), 3),  # ceil(25 / 10)
        (T, load(replicas=3, ready=3, rps=31.0), 3),  # within 10 % of 3 x 10: stays
        (T, load(rps=0.0), 0),  # before min: the scaler's floor
        (Targets(1, 4, gpu_util=70.0), load(replicas=2, ready=2, util=95.0), 3),
        (Targets(1, 4, gpu_util=70.0), load(replicas=2, ready=2, util=74.0), 2),  # tolerance
        (Targets(1, 4, gpu_util=70.0), load(replicas=2, ready=2, util=None), 1),  # unknown
        (Targets(1, 4, gpu_util=50.0, rps=10.0), load(rps=15.0, util=90.0), 2),  # larger wins
        (Targets(2, 4), load(), 2),  # no target: min
        # a connection per replica (a stream's clients): the open and the waiting ones
        (Targets(0, 4, connections=1), Load(0, 1, 1, 0.0, None, False, None, 2), 2),
        (Targets(0, 8, connections=3), Load(0, 1, 1, 0.0, None, False, None, 7), 3),
    ],
)
def test_the_need_now(targets, now, want):
    assert need_now(targets, now).replicas == want


def test_up_at_once_down_only_after_the_window():
    scaler = Scaler(T)
    assert scaler.decide(load(t=0, rps=40.0)).replicas == 4
    # the load is gone, but the window still holds the need for 4
    assert scaler.decide(load(t=10, replicas=4, ready=4)).replicas == 4
    assert scaler.decide(load(t=31, replicas=4, ready=4)).replicas == 1


def test_to_zero_after_quiet_and_back_on_a_waiting_request():
    scaler = Scaler(Targets(least=0, most=2, rps=10.0, down_after_s=0, to_zero_after_s=60))
    assert scaler.decide(load(t=100, rps=0.0, last=90)).replicas == 1  # quiet for 10 s only
    to_zero = scaler.decide(load(t=151, rps=0.0, last=90))
    assert to_zero == Need(0, "no request for 60 s: to zero")
    assert scaler.decide(load(t=152, replicas=0, ready=0, last=90)).replicas == 0
    woken = scaler.decide(load(t=200, replicas=0, ready=0, waiting=True, last=200))
    assert woken == Need(1, "a request waits for a replica")


def test_never_above_max():
    assert Scaler(T).decide(load(rps=1000.0)).replicas == 4


@pytest.mark.parametrize(
    ("line", "logged"),
    [
        ("gpuflow-request r2 200 35 20", Request("r2", 200, 35, 20)),
        ("gpuflow-request <NOSRV> 503 5000 -1", Request("<NOSRV>", 503, 5000, -1)),
        ("[WARNING]  (1) : Server replicas/r1 is UP", None),
        ("gpuflow-request r1 two 3 4", None),
    ],
)
def test_request_lines(line, logged):
    assert request_of(line) == logged


def test_the_endpoint_retries_elsewhere_and_sends_only_to_ready_replicas(tmp_path):
    endpoint = Endpoint("127.0.0.1", 8080, slots=4, wait_s=30.0, server_timeout_s=60.0)
    text = config(tmp_path / "endpoint", endpoint)
    assert "retry-on conn-failure empty-response response-timeout 503" in text
    assert "option redispatch" in text
    assert "server-template r 1-4 127.0.0.1:1 disabled" in text  # out until made ready
    assert "lua.gpuflow_wait replicas 30000 if { nbsrv(replicas) eq 0 }" in text
    assert "stats socket unix@endpoint/admin.sock mode 600 level admin" in text
    assert "timeout queue 30s" in text
    # connections per replica bounded: one more waits in the queue for the replica it needs
    bounded = config(tmp_path / "endpoint", dataclasses.replace(endpoint, per_server=1))
    assert "server-template r 1-4 127.0.0.1:1 disabled maxconn 1" in bounded
