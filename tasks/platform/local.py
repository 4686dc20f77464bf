"""The local platform: a Prefect server on 127.0.0.1 (SQLite under $GPUFLOW_HOME/platform,
or the host's PostgreSQL server started for it with `--database postgresql`),
gpuflow's work pools, a `gpu` concurrency limit sized to this host's GPUs, the blocks, the
deployments of prefect.yaml and a process worker; `down` stops what `up` started, by PID.

Given a kubeconfig, `up` also deploys the Kubernetes deployments (with an image already
pushed: nothing is built) and starts gpuflow's Kubernetes worker for the gpuflow-gpu-k8s
pool on that cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import yaml

from gpuflow.tasks import nvml, yamlfile
from gpuflow.tasks.backends.kubernetes.kubeapi import (
    KubeApi,
    KubeError,
    KubeUnreachable,
    load_config,
)
from gpuflow.tasks.backends.local.gpu_slots import LIMIT_NAME
from gpuflow.tasks.errors import GpuflowError, InvalidSpec
from gpuflow.tasks.host import open_private, private_dir, secure_home, stop_group, write_atomic
from gpuflow.tasks.platform import portguard, postgres
from gpuflow.tasks.platform.api import start_timeout_s, startup_error, stop_kept
from gpuflow.tasks.platform.blocks_setup import init_blocks
from gpuflow.tasks.platform.deploy import (
    GPU_K8S_POOL,
    IMAGE_VARIABLE,
    LOCAL_POOL,
    check_project,
    load_project,
    pool_templates,
    prefect_deploy,
)
from gpuflow.tasks.platform.reap import reap
from gpuflow.tasks.platform.state import auth as platform_auth
from gpuflow.tasks.platform.state import (
    auth_path,
    half_started,
    platform_dir,
    read_state,
    running,
    state_path,
    users_path,
)
from gpuflow.tasks.platform.state import trust as platform_trust
from gpuflow.tasks.platform.tls import Listening, client_context, listening

# gpuflow's own prefect.yaml: the repository's (gpuflow/prefect.yaml links to it), or the
# copy inside the installed package; its folder is where `prefect deploy` runs
PROJECT_FILE = (Path(__file__).parents[2] / "prefect.yaml").resolve()
ROOT = PROJECT_FILE.parent


DEFAULT_PORT = 4200


class PlatformError(GpuflowError):
    """The platform could not start; the message says what to look at."""


def _start(argv: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    with open_private(log) as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "log": str(log)}


def _port_taken(port: int, address: str = "127.0.0.1") -> str | None:
    """Return who holds `port` on `address` (a sentence), or None when it is free."""
    # as the server binds it: this user's clients holding the port (portguard) are no
    # obstacle; another user's program, or a server answering there, is
    with portguard.reusable_socket(address, server=True) as probe:
        try:
            probe.bind((address, port))
        except OSError as exc:
            return f"port {port} on {address} is taken ({exc.strerror or exc})"
    with contextlib.suppress(OSError):
        connect_to = "127.0.0.1" if address == "0.0.0.0" else "::1" if address == "::" else address
        with socket.create_connection((connect_to, port), timeout=0.5):
            return f"port {port} on {address} is taken (a server answers there)"
    return None


def _port_free(port: int, address: str, renew: bool, say: Any) -> None:
    """PlatformError when another program holds the port; with `renew` (a platform was
    there before), its auth string is renewed first: its clients may have sent it there."""
    if taken := _port_taken(port, address):
        if renew and auth_path().exists():
            auth_path().unlink()
            say("the platform's auth string was renewed: its port is held by another program")
        raise PlatformError(
            f"{taken}: another program (perhaps another Prefect server) listens there;"
            " stop it, or start the platform on a free port with --port."
        )


def _listens(pid: int, port: int) -> bool:
    """Return True when the process `pid` or one of its children listens on `port`: the
    server that answers there is the one started, not another one."""
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                for conn in proc.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                        return True
    except psutil.Error:
        return False
    return False


def _wait_healthy(
    api: str, server: dict[str, Any], timeout_s: float, port: int, trust: str | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not running(server):
            tail = Path(server["log"]).read_text(errors="replace")[-1500:]
            raise PlatformError(f"the Prefect server exited while starting; its log ends: {tail}")
        if _listens(server["pid"], port):
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(
                    f"{api}/health", timeout=2, context=client_context(trust)
                ) as response,
            ):  # /health answers without the auth string, as Prefect's probes expect
                if response.status == 200:
                    return
        time.sleep(0.25)
    said = startup_error(Path(server["log"]).read_text(errors="replace"))
    raise PlatformError(
        f"the Prefect server did not answer {api}/health within {timeout_s:.0f} s (the machine"
        f" may be busy; its log {server['log']} ends: {said}); set GPUFLOW_API_START_TIMEOUT_S"
        " higher"
    )


DATABASES = ("sqlite", "postgresql")


def platform_env(api: str, trust: str | None = None) -> dict[str, str]:
    """Return the environment for processes that talk to the platform's server (its auth
    string included: the worker's flow runs inherit it; and the certificate it is trusted
    by, when it serves TLS with a generated one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=api,
        PREFECT_API_AUTH_STRING=platform_auth(),
        PREFECT_HOME=str(platform_dir() / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
    )
    if trust:
        env["PREFECT_API_SSL_CERT_FILE"] = trust
    return env


def _server_env(env: dict[str, str], database: dict[str, Any]) -> dict[str, str]:
    """Return the Prefect server's environment: `env` and its database (the PostgreSQL URL,
    which holds the password, goes to the server alone)."""
    if database["kind"] == "postgresql":
        url = postgres.connection_url(database["port"])
        return {**env, "PREFECT_API_DATABASE_CONNECTION_URL": url}
    return {
        **env,
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database['file']}",
        # SQLite takes one writer at a time: wait for the lock rather than answer 503
        "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    }


def runs_kept_in(database: dict[str, Any] | None) -> str:
    """Return where the platform's runs are kept, for the user."""
    if not database or database["kind"] == "sqlite":
        return f"SQLite {(database or {}).get('file') or platform_dir() / 'prefect.db'}"
    return f"PostgreSQL {database['version']}, data in {database['data']}"


def up(
    port: int | None = None,
    say=print,
    kubeconfig: Path | None = None,
    image: str | None = None,
    database: str = "sqlite",
    listen: str = "127.0.0.1",
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    use: bool = False,
) -> dict[str, Any]:
    """Start (or find running) the local platform; return its state: api, ui, processes.
    With `use`, the Prefect profile `gpuflow` (the platform's) becomes the active one.
    With `kubeconfig`, also a Kubernetes worker on that cluster running `image`; with
    `database="postgresql"`, the server keeps its runs in a PostgreSQL server started for it;
    with `listen` other than loopback, the server is shared over TLS 1.3 (tasks/platform/tls.py)."""
    if database not in DATABASES:
        raise InvalidSpec(f"--database: {database!r} is not one of {', '.join(DATABASES)}.")
    before = read_state()
    if before and all(running(p) for p in before["processes"].values()) and _whole(before, say):
        return _already_running(before, kubeconfig, database, use, say, port)
    port = DEFAULT_PORT if port is None else port
    if not 1 <= port <= 65535:
        raise InvalidSpec(f"--port: {port} is not a TCP port; give one from 1 to 65535.")
    if database == "postgresql":
        postgres.programs()  # installed? (one sentence before anything starts)
    cluster = _cluster(kubeconfig, image) if kubeconfig else None
    secure_home()
    where = listening(listen, tls_cert, tls_key, platform_dir() / "tls")
    if before:
        down(say=lambda *_: None)  # a half-dead platform: clear it first
    _port_free(port, where.bind, renew=bool(before), say=say)
    started = time.monotonic()
    private_dir(platform_dir())
    platform_auth()  # made before anything that needs it starts
    api, ui = f"{where.url(port)}/api", where.url(port, where.shown)
    env = platform_env(api, where.trust)
    processes: dict[str, Any] = {}
    state: dict[str, Any] = {
        "api": api,
        "ui": ui,
        "processes": processes,
        "listening": where.model_dump(),
        # until `up_seconds` is written, this `up` is starting it (half_started says when not)
        "starter": {"pid": os.getpid(), "started": psutil.Process().create_time()},
    }
    try:
        if database == "postgresql":
            processes["postgres"], state["database"] = postgres.start(say)
            _write_state(state)
        else:
            state["database"] = {"kind": "sqlite", "file": str(platform_dir() / "prefect.db")}
        processes["server"] = _start_server(where, port, env, state)
        _write_state(state)
        _wait_healthy(api, processes["server"], start_timeout_s(), port, where.trust)
        say(
            f"started the Prefect server (pid {processes['server']['pid']}) at {ui} in"
            f" {time.monotonic() - started:.1f} s; log {processes['server']['log']}"
        )
        limit = _start_workers(state, env, say, cluster, _configure(api, env, say, cluster))
    except BaseException:
        down(say=lambda *_: None)
        raise
    state["up_seconds"] = round(time.monotonic() - started, 1)
    _write_state(state)
    say(
        f"started a process worker (pid {processes['worker']['pid']}) on the pool {LOCAL_POOL},"
        f" {limit} flow runs at a time"
    )
    say(
        f"up in {state['up_seconds']} s: UI {ui}; runs kept in {runs_kept_in(state['database'])};"
        " `gpuflow run` now records runs here; `gpuflow platform down` stops it"
    )
    _say_who_gets_in(say, where, api, ui, port)
    try:
        _say_profile(say, write_profile(api, where.trust, use=use))
    except OSError as exc:  # a read-only PREFECT_HOME: the export line above still works
        say(f"Prefect's profile {PROFILE} could not be written ({exc.strerror or exc})")
    return state


def _whole(state: dict[str, Any], say: Any) -> bool:
    """Return True when the running platform is whole; False (said) when its `up` ended
    before its worker started, to be stopped and started again; PlatformError while
    another `up` is still starting it."""
    if (half := half_started(state)) is not None:
        say(f"the platform was {half.split(';')[0]}: stopping what it started, then starting it")
        return False
    if state.get("up_seconds") is None:
        raise PlatformError(
            f"another `gpuflow platform up` (pid {state['starter']['pid']}) is starting the"
            " platform; wait for it to say `up in ...`, or stop it and run `up` again"
        )
    return True


def _already_running(
    state: dict[str, Any],
    kubeconfig: Path | None,
    database: str,
    use: bool,
    say: Any,
    port: int | None = None,
) -> dict[str, Any]:
    """Return the running platform's state once it is the one asked for; with `use`, make
    its profile the active one."""
    _same_platform(state, kubeconfig, database)
    running_on = urlsplit(state["api"]).port
    if port is not None and port != running_on:
        raise PlatformError(
            f"the platform already runs on port {running_on}, not {port}: --port {port} was"
            f" not used; run `gpuflow platform down`, then `up --port {port}`, to move it"
        )
    say(f"already running: UI {state['ui']}")
    if use:
        _say_profile(say, write_profile(state["api"], platform_trust(state), use=True))
    return state


def _same_platform(state: dict[str, Any], kubeconfig: Path | None, database: str) -> None:
    """Raise PlatformError when the platform already running is not the one asked for
    (no Kubernetes worker, another database)."""
    if kubeconfig and "k8s-worker" not in state["processes"]:
        raise PlatformError(
            "the platform already runs without a Kubernetes worker; run `gpuflow platform"
            " down`, then `up` again with --kubeconfig"
        )
    kind = state.get("database", {}).get("kind", "sqlite")
    if kind != database:
        raise PlatformError(
            f"the platform already runs on {kind}; run `gpuflow platform down`, then `up`"
            f" again with --database {database} (runs kept in {kind} stay there)"
        )


def _start_workers(
    state: dict[str, Any],
    env: dict[str, str],
    say: Any,
    cluster: dict[str, Any] | None,
    gpus: int,
) -> int:
    """Start the process worker (and, for a cluster, the Kubernetes worker), recording
    each in `state`; return how many flow runs the process worker takes at once."""
    processes, python = state["processes"], sys.executable
    # Runs beyond what the GPUs take would only wait for a slot, each a Python process
    # holding a database connection: the worker starts a few more than that, the rest
    # wait as Scheduled (SQLite answered "database is locked" to 50 at once).
    limit = max(4, gpus + 1)
    worker = ["worker", "start", "--pool", LOCAL_POOL, "--type", "process"]
    # the worker holds the API's port as long as it lives (tasks/platform/portguard.py):
    # were the server to die, no other user could take the port and get its polls
    guard = [python, "-m", "gpuflow.tasks.platform.portguard", state["api"], "--"]
    processes["worker"] = _start(
        [*guard, python, "-m", "prefect", *worker, "--limit", str(limit)],
        env,
        platform_dir() / "worker.log",
    )
    # runs waiting for their team's GPU quota wait parked; this starts them once admitted
    processes["admitter"] = _start(
        [*guard, python, "-m", "gpuflow.tasks.platform.admitter", str(platform_dir())],
        env,
        platform_dir() / "admitter.log",
    )
    _write_state(state)
    if cluster:
        worker = ["worker", "start", "--pool", GPU_K8S_POOL]
        worker += ["--type", pool_templates()[GPU_K8S_POOL][0]]
        processes["k8s-worker"] = _start(
            [*guard, python, "-m", "prefect", *worker],
            {
                **env,
                **_auth_secret(cluster),
                "KUBECONFIG": str(cluster["kubeconfig"]),
                # watch the jobs' namespace only: what worker-rbac.yaml grants
                "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES": cluster["namespace"],
            },
            platform_dir() / "k8s-worker.log",
        )
        _write_state(state)
        say(
            f"started a Kubernetes worker (pid {processes['k8s-worker']['pid']}) on the pool"
            f" {GPU_K8S_POOL} for {cluster['server']}, namespace {cluster['namespace']};"
            f" jobs run {cluster['image']}"
        )
    return limit


PROFILE = "gpuflow"


def write_profile(api: str, trust: str | None, use: bool = False) -> tuple[Path, str | None]:
    """Write (or update) the Prefect profile `gpuflow` that points Prefect's CLI and the
    user's own scripts at the platform, with its auth string; the active profile stays as
    it was, unless `use` makes this one active. Return the profiles file and the active
    profile's name."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_URL,
        PREFECT_PROFILES_PATH,
        load_profiles,
        save_profiles,
    )

    profiles = load_profiles(include_defaults=False)
    profiles.update_profile(
        PROFILE,
        {
            PREFECT_API_URL: api,
            PREFECT_API_AUTH_STRING: platform_auth(),
            PREFECT_API_SSL_CERT_FILE: trust,  # None drops an earlier one
        },
    )
    if use:
        profiles.set_active(PROFILE)
    save_profiles(profiles)
    path = Path(PREFECT_PROFILES_PATH.value())
    os.chmod(path, 0o600)  # it holds the auth string now
    return path, profiles.active_name


def _say_profile(say: Callable[[str], None], written: tuple[Path, str | None]) -> None:
    path, active = written
    if active == PROFILE:
        say(
            f"the profile {PROFILE} is the active one: Prefect's CLI, your own flows and"
            f" `Secret(...).save(...)` use the platform (written to {path}; `prefect profile"
            " use default` goes back)"
        )
        return
    still = (
        f"your active profile ({active}) is unchanged; `gpuflow platform up --use` makes"
        f" {PROFILE} the active one"
        if active
        else f"no profile was made active; `gpuflow platform up --use` makes {PROFILE} the one"
    )
    say(
        f"Prefect's CLI and your own flows reach it with the profile {PROFILE}"
        f" (`prefect profile use {PROFILE}`, or PREFECT_PROFILE={PROFILE} for one command),"
        f" written to {path}; {still}"
    )


def _start_server(
    where: Listening, port: int, env: dict[str, str], state: dict[str, Any]
) -> dict[str, Any]:
    """Start the platform's Prefect server (tasks/platform/server.py: the UI, the auth
    string from its file, TLS when shared); return its process entry."""
    argv = [sys.executable, "-m", "gpuflow.tasks.platform.server", "--ui", "--host", where.bind]
    argv += ["--port", str(port), "--auth-file", str(auth_path()), "--users", str(users_path())]
    if where.cert:
        argv += ["--tls-cert", where.cert, "--tls-key", str(where.key)]
        for name in sorted({socket.gethostname(), socket.getfqdn(), where.shown}):
            argv += ["--name", name]  # the Host names it answers to besides addresses
    # the UI's pages call the API by the address a teammate's browser reaches
    server_env = {**_server_env(env, state["database"]), "PREFECT_UI_API_URL": f"{state['ui']}/api"}
    return _start(argv, server_env, platform_dir() / "server.log")


def _say_who_gets_in(say, where: Listening, api: str, ui: str, port: int) -> None:
    """Say how the user's own tools get in, and a teammate's when the platform is shared."""
    say(
        f"only you get in: the UI and Prefect's CLI ask for the auth string in {auth_path()}"
        f' (export PREFECT_API_URL={api} PREFECT_API_AUTH_STRING="$(cat {auth_path()})"'
        + (f" PREFECT_API_SSL_CERT_FILE={where.trust})" if where.trust else ")")
    )
    if where.shared:
        say(
            f"shared over TLS 1.3 on {where.bind}:{port}: a teammate sets PREFECT_API_URL="
            f"{ui}/api, PREFECT_API_AUTH_STRING (from you, not by mail or chat in the clear)"
            + (f" and PREFECT_API_SSL_CERT_FILE (a copy of {where.trust})" if where.trust else "")
        )


def _cluster(kubeconfig: Path, image: str | None) -> dict[str, Any]:
    """Return the cluster a Kubernetes worker would use, after checking the kubeconfig loads,
    its API server answers and a job image is named; InvalidSpec/PlatformError otherwise."""

    if not kubeconfig.is_file():
        raise InvalidSpec(f"--kubeconfig: {kubeconfig} is not a file; name your kubeconfig")
    image = image or os.environ.get(IMAGE_VARIABLE, "")
    if not image.strip():
        raise InvalidSpec(
            f"--image: name the job image the Kubernetes pods run (already pushed), or set"
            f" {IMAGE_VARIABLE}; infra/docker/Dockerfile builds it"
        )
    loaded = yamlfile.read(kubeconfig, "your kubeconfig (--kubeconfig)")
    if loaded is not None and not isinstance(loaded, dict):
        raise InvalidSpec(f"--kubeconfig: {kubeconfig} is not a kubeconfig; name your kubeconfig")
    config = load_config(loaded or {})
    api = KubeApi(config.model_copy(update={"source": str(kubeconfig)}))
    namespace = config.namespace
    try:
        api.request("GET", "/version")
        api.request("GET", f"/api/v1/namespaces/{namespace}")
    except KubeUnreachable as exc:
        raise PlatformError(f"the cluster in {kubeconfig} cannot be used: {exc}") from None
    except KubeError as exc:
        if exc.status == 404:
            raise InvalidSpec(
                f"--kubeconfig: the namespace {namespace!r} its context names does not exist on"
                f" {config.server}; create it or name another in the context"
            ) from None
        if exc.status != 403:  # a worker need not read namespaces
            raise PlatformError(f"the cluster in {kubeconfig} cannot be used: {exc}") from None
    finally:
        api.close()
    return {
        "kubeconfig": kubeconfig.resolve(),
        "server": config.server,
        "namespace": namespace,
        "image": image.strip(),
    }


# The Secret in the jobs' namespace that holds the platform's auth string: the Kubernetes
# worker makes flow-run pods read it from there (prefect-kubernetes' own settings), so it is
# never in a Job's manifest.
AUTH_SECRET, AUTH_SECRET_KEY = "gpuflow-prefect-auth", "auth-string"


def _auth_secret(cluster: dict[str, Any]) -> dict[str, str]:
    """Write the platform's auth string into the Secret AUTH_SECRET of the cluster's
    namespace (made, or replaced by a new platform's); return the worker's settings that
    name it. One sentence when the account may not."""
    namespace = cluster["namespace"]
    config = load_config(yamlfile.read(cluster["kubeconfig"], "your kubeconfig") or {})
    kube = KubeApi(config.model_copy(update={"source": str(cluster["kubeconfig"])}))
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": AUTH_SECRET, "labels": {"app.kubernetes.io/managed-by": "gpuflow"}},
        "type": "Opaque",
        "stringData": {AUTH_SECRET_KEY: platform_auth()},
    }
    path = f"/api/v1/namespaces/{namespace}/secrets"
    try:
        try:
            kube.request("PUT", f"{path}/{AUTH_SECRET}", body)
        except KubeError as exc:
            if exc.status != 404:
                raise
            kube.request("POST", path, body)
    except (KubeError, KubeUnreachable) as exc:
        raise PlatformError(
            f"the platform's auth string could not be put into the Secret {AUTH_SECRET} in"
            f" {namespace} ({exc}); grant the account what infra/kubernetes/worker-rbac.yaml"
            f" grants, or create it: kubectl -n {namespace} create secret generic"
            f" {AUTH_SECRET} --from-file={AUTH_SECRET_KEY}={auth_path()}"
        ) from None
    finally:
        kube.close()
    prefix = "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_"
    return {f"{prefix}NAME": AUTH_SECRET, f"{prefix}KEY": AUTH_SECRET_KEY}


def _configure(api: str, env: dict[str, str], say, cluster: dict[str, Any] | None) -> int:
    """Create the pools, the `gpu` limit and the blocks, then deploy prefect.yaml (its
    Kubernetes deployments only with a cluster, running its image as given)."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_URL,
        temporary_settings,
    )

    pools = pool_templates()
    project = load_project(PROJECT_FILE)
    only = {LOCAL_POOL, GPU_K8S_POOL} if cluster else {LOCAL_POOL}
    deploy_env = {**env, IMAGE_VARIABLE: cluster["image"]} if cluster else env
    names = check_project(project, ROOT, pools, only=only, env=deploy_env)
    prefect_file = None
    if cluster:  # the image is given: deploy without the build and push steps
        for deployment in project["deployments"]:
            for steps in ("build", "push"):
                deployment.pop(steps, None)
            if deployment["work_pool"]["name"] == GPU_K8S_POOL:
                variables = deployment["work_pool"].setdefault("job_variables", {})
                variables.setdefault("namespace", cluster["namespace"])
        prefect_file = platform_dir() / "prefect.yaml"
        write_atomic(prefect_file, yaml.safe_dump(project, sort_keys=False))
    settings = {PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: platform_auth()}
    if env.get("PREFECT_API_SSL_CERT_FILE"):
        settings[PREFECT_API_SSL_CERT_FILE] = env["PREFECT_API_SSL_CERT_FILE"]
    with temporary_settings(settings):
        _pools(pools)
        gpus = _gpu_limit()

        init_blocks()
    say(f"pools {', '.join(pools)}; concurrency limit gpu = {gpus}; blocks registered")
    done = prefect_deploy(ROOT, deploy_env, names=names, prefect_file=prefect_file)
    if done.returncode != 0:
        raise PlatformError(f"prefect deploy failed: {(done.stdout + done.stderr)[-1500:]}")
    say(f"{len(names)} deployments created from prefect.yaml")
    return gpus


def _pools(pools: dict[str, tuple[str, dict[str, Any]]]) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from gpuflow.tasks.api_client import api_client

    with api_client() as client:
        for name, (kind, template) in pools.items():
            try:
                client.read_work_pool(name)
                client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
            except ObjectNotFound:
                client.create_work_pool(
                    WorkPoolCreate(name=name, type=kind, base_job_template=template)
                )


def _gpu_limit() -> int:
    """Create or resize the `gpu` global concurrency limit to this host's GPUs."""
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
    )
    from prefect.exceptions import ObjectNotFound

    from gpuflow.tasks.api_client import api_client

    gpus = len(nvml.query().gpus)
    with api_client() as client:
        try:
            client.read_global_concurrency_limit_by_name(LIMIT_NAME)
            client.update_global_concurrency_limit(
                LIMIT_NAME, GlobalConcurrencyLimitUpdate(limit=gpus)
            )
        except ObjectNotFound:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=LIMIT_NAME, limit=gpus)
            )
    return gpus


def _write_state(state: dict[str, Any]) -> None:
    write_atomic(state_path(), json.dumps(state, indent=2))


def down(say=print) -> list[str]:
    """Stop what `up` started (worker first, then server), by PID; return what was stopped.
    Processes whose PID was reused by something else are left alone."""
    state = read_state()
    stopped: list[str] = []
    # A temporary API that earlier commands kept goes too (one in use stops once idle).
    kept = stop_kept(say)
    if state is None:
        if not kept:
            say("nothing is running")
        return stopped
    for name in ("k8s-worker", "admitter", "worker", "server", "postgres"):
        entry = state["processes"].get(name)
        if entry and running(entry):
            if name == "postgres":
                postgres.stop(entry)
            else:
                stop_group(entry["pid"], None, grace_s=15.0)
            stopped.append(name)
            say(f"stopped the {name} (pid {entry['pid']})")
        if name == "worker":
            # Runs the worker still had: torn down and marked Crashed while the server is up.
            reap(dry_run=False, say=lambda line: say(f"  {line}"))
    state_path().unlink(missing_ok=True)
    say(
        f"stopped: {', '.join(stopped) or 'nothing was still running'}; the UI at"
        f" {state['ui']} is down (runs stay in {runs_kept_in(state.get('database'))})"
    )
    return stopped
