"""Container engines on a host (podman, docker): finding one, pulling an image and pinning
it by digest, the command that runs a unit in it, and removing what a run made.

Every function here works on the host it runs on; a backend that reaches another host runs
the same engine commands there. Images stay cached in the engine's store after a run, on
purpose (the next run starts warm); containers never outlive their cluster.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuflow.tasks.errors import InvalidSpec

ENGINES = ("podman", "docker")
LABEL = "io.gpuflow.cluster"  # every container a run makes carries its cluster's name
CDI_GPU = "nvidia.com/gpu"  # the NVIDIA Container Toolkit's CDI kind (GPUFLOW_CDI_KIND)
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le"}


@dataclass(frozen=True)
class Engine:
    """One container engine's program on this host."""

    name: str  # podman | docker
    path: str

    def argv(self, *args: str) -> list[str]:
        return [self.path, *args]

    def run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run one engine command; its output is text, its failure the caller's to read."""
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            env=engine_environ(),
        )


@dataclass(frozen=True)
class Pinned:
    """An image as a run runs it: the reference written, the digest every unit runs (the
    registry's manifest digest, the same on every host that pulls it) and the local id."""

    ref: str
    digest: str
    image_id: str
    architecture: str
    user: str

    @property
    def pinned_ref(self) -> str:
        """`name@digest`: what another host pulls to run exactly this image."""
        name = name_of(self.ref)
        return f"{name}@{self.digest}" if self.digest else self.ref


def engine_environ() -> dict[str, str]:
    """The environment engine commands run with: this process's, less what a job's secrets
    or gpuflow's credentials put there (an engine needs none of them)."""
    from gpuflow.tasks.host import job_environ

    return job_environ()


def find_engine(wanted: str | None = None, path: str | None = None) -> Engine:
    """Return the first engine that answers here (podman, then docker), or `wanted`; one
    sentence naming what to install otherwise. A docker client whose daemon does not
    answer is not an engine."""
    names = (wanted,) if wanted else ENGINES
    seen: list[str] = []
    for name in names:
        program = shutil.which(name, path=path)
        if program is None:
            continue
        engine = Engine(name, program)
        if name == "docker":
            try:
                answer = engine.run("version", "--format", "{{.Server.Version}}", timeout_s=15)
            except subprocess.TimeoutExpired:
                seen.append("docker's daemon did not answer in 15 s")
                continue
            if answer.returncode != 0:
                why = _last_line(answer.stderr) or "its daemon does not answer"
                seen.append(f"docker is installed but {why}")
                continue
        return engine
    found = f" ({'; '.join(seen)})" if seen else ""
    which = wanted or "podman (apt-get install podman) or docker"
    raise InvalidSpec(
        f"image: this host has no container engine to run it{found}; install {which}, or"
        " remove image to run on the host's own programs."
    )


def name_of(ref: str) -> str:
    """A reference's name: without its tag and digest."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].removeprefix("Error: ").removeprefix("error: ") if lines else ""


@contextlib.contextmanager
def auth_file(
    registry: str | None, username: str | None, password: str | None
) -> Iterator[str | None]:
    """Yield a private folder holding a `config.json` with the registry's credentials (the
    format podman's --authfile and docker's --config both read), removed afterwards; None
    without credentials. Only this user can read it; the job never sees it."""
    if not (registry and username and password):
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="gpuflow-registry-"))  # mode 0700
    try:
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        path = folder / "config.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {registry: {"auth": token}}}, f)
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def registry_of(ref: str) -> str:
    """The registry host a reference names (docker.io for a bare name)."""
    first, sep, _ = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def _auth_args(engine: Engine, folder: str | None) -> tuple[list[str], list[str]]:
    """Engine-wide and pull arguments that use the credentials in `folder`."""
    if folder is None:
        return [], []
    if engine.name == "docker":
        return ["--config", folder], []
    return [], ["--authfile", str(Path(folder) / "config.json")]


def inspect(engine: Engine, ref: str) -> dict | None:
    """The engine's description of a local image, or None when it has none by that name."""
    answer = engine.run("image", "inspect", ref, timeout_s=60)
    if answer.returncode != 0:
        return None
    found = json.loads(answer.stdout or "[]")
    return found[0] if found else None


def pull(
    engine: Engine,
    ref: str,
    say: Callable[[str], None],
    credentials: tuple[str | None, str | None] = (None, None),
    policy: str | None = None,
) -> Pinned:
    """Pull `ref` as `policy` says ("always", "missing", "never"; None: always for a
    `latest` or untagged reference, else missing) and return it pinned; one sentence for
    an image that cannot be had (not found, unauthorised, no network, no space)."""
    policy = policy or ("always" if _floating(ref) else "missing")
    described = None if policy == "always" else inspect(engine, ref)
    if described is None and policy == "never":
        raise InvalidSpec(
            f"image: {ref!r} is not in {engine.name}'s store here and image.pull is never;"
            f" pull it ({engine.name} pull {ref}) or set image.pull: missing."
        )
    if described is None:
        username, password = credentials
        with auth_file(registry_of(ref), username, password) as folder:
            wide, own = _auth_args(engine, folder)
            _pull(engine, ref, say, wide, own, has_credentials=folder is not None)
        described = inspect(engine, ref)
        if described is None:
            raise InvalidSpec(
                f"image: {engine.name} pulled {ref!r} but does not show it; pull it again."
            )
    return pinned_from(ref, described)


def _floating(ref: str) -> bool:
    if "@" in ref:
        return False
    last = ref.rsplit("/", 1)[-1]
    return ":" not in last or last.endswith(":latest")


def _pull(
    engine: Engine,
    ref: str,
    say: Callable[[str], None],
    wide: list[str],
    own: list[str],
    has_credentials: bool,
) -> None:
    say(f"pulling {ref} with {engine.name}")
    proc = subprocess.Popen(
        engine.argv(*wide, "pull", *own, ref),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=engine_environ(),
    )
    said: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            said.append(line)
            say(f"  {line}")
    if proc.wait() != 0:
        raise InvalidSpec(pull_failure(ref, "\n".join(said[-20:]), has_credentials))


_PULL_FAILURES: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"unauthori[sz]ed|authentication required|401|denied: requested access", re.I),
        "the registry refused it without valid credentials ({detail}); {fix_auth}",
    ),
    (
        re.compile(r"manifest unknown|not found|name unknown|does not exist|404", re.I),
        "the registry has no such image ({detail}); check the name and tag, or push it",
    ),
    (
        re.compile(r"no space left on device", re.I),
        "the host has no space left to unpack it ({detail}); free space in the engine's"
        " store or remove unused images",
    ),
    (
        re.compile(
            r"connection refused|no such host|i/o timeout|network is unreachable|"
            r"dial tcp|TLS handshake|server gave HTTP response|certificate",
            re.I,
        ),
        "the registry could not be reached ({detail}); check the address, the network and"
        " the engine's registry settings (a plain-HTTP registry is marked insecure there)",
    ),
]


def pull_failure(ref: str, said: str, has_credentials: bool) -> str:
    """One sentence for a failed pull, from what the engine said."""
    detail = _last_line(said)[:300] or "no message"
    fix_auth = (
        "check the user and password in image.credentials' block"
        if has_credentials
        else "name a RegistryCredentials block in image.credentials"
    )
    for pattern, sentence in _PULL_FAILURES:
        if pattern.search(said):
            return (
                f"image: {ref!r} cannot be pulled: "
                + sentence.format(detail=detail, fix_auth=fix_auth)
                + "."
            )
    return f"image: {ref!r} cannot be pulled ({detail}); check the reference and the registry."


def pinned_from(ref: str, described: Mapping) -> Pinned:
    digests = described.get("RepoDigests") or []
    name = name_of(ref)
    digest = ""
    if "@" in ref:
        digest = ref.split("@", 1)[1]
    else:
        for repo_digest in digests:
            repo, _, found = str(repo_digest).partition("@")
            if repo == name or repo.endswith("/" + name):
                digest = found
                break
        if not digest and described.get("Digest"):
            digest = str(described["Digest"])
    config = described.get("Config") or {}
    return Pinned(
        ref=ref,
        digest=digest,
        image_id=str(described.get("Id", "")),
        architecture=str(described.get("Architecture", "")),
        user=str(config.get("User") or ""),
    )


def host_architecture() -> str:
    machine = platform.machine().lower()
    return ARCHITECTURES.get(machine, machine)


def check_architecture(pinned: Pinned) -> None:
    """One sentence when the image is for another machine than this host."""
    host = host_architecture()
    if pinned.architecture and pinned.architecture != host:
        raise InvalidSpec(
            f"image: {pinned.ref!r} is built for {pinned.architecture}, this host is {host};"
            f" build or pull the {host} variant (a multi-platform image has one)."
        )


def _kept(pinned: Pinned, name: str, ask: Callable[[], object]) -> object:
    """An answer about the image, asked once: an image's files never change under its id,
    so the answer is kept ($GPUFLOW_HOME/images/NAME.json) and the next run of it starts no
    container to ask again."""
    from gpuflow.tasks.host import gpuflow_home, make_dirs, read_state_json, write_atomic

    kept = gpuflow_home() / "images" / f"{name}.json"
    known = read_state_json(kept) if pinned.image_id and kept.is_file() else None
    if isinstance(known, dict) and known.get("image") == pinned.image_id and "answer" in known:
        return known["answer"]
    answer = ask()
    if pinned.image_id:
        make_dirs(kept.parent)
        write_atomic(kept, json.dumps({"image": pinned.image_id, "answer": answer}))
    return answer


def probe(engine: Engine, pinned: Pinned, programs: Sequence[str]) -> list[str]:
    """Return which of `programs` the image lacks (looked up by its shell, once per image:
    `_kept`); one sentence when the image has no shell to look with."""
    if not programs:
        return []
    key = hashlib.sha256(json.dumps([pinned.image_id, sorted(programs)]).encode()).hexdigest()
    missing = _kept(pinned, f"probe-{key[:32]}", lambda: _probe(engine, pinned, programs))
    return [str(p) for p in missing] if isinstance(missing, list) else []


def python_abi(engine: Engine, pinned: Pinned) -> str | None:
    """The ABI of the image's python3 (its SOABI: `cpython-311-x86_64-linux-gnu`), "" for
    a python3 too old to say, None for an image without one; asked once per image."""
    abi = _kept(pinned, f"abi-{pinned.image_id[:40]}", lambda: _python_abi(engine, pinned))
    return abi if isinstance(abi, str) else None


def _python_abi(engine: Engine, pinned: Pinned) -> str | None:
    code = "import sysconfig; print(sysconfig.get_config_var('SOABI') or '')"
    answer = engine.run(
        "run", "--rm", "--network", "none", "--entrypoint", "python3",
        pinned.image_id or pinned.ref, "-c", code, timeout_s=120,
    )  # fmt: skip
    if answer.returncode == 0:
        return answer.stdout.strip()
    said = _last_line(answer.stderr)
    if not re.search(r"no such file|not found|executable file", said, re.I):
        raise InvalidSpec(f"image: {pinned.ref!r} cannot be started here ({said[:300]}).")
    return None  # no python3


def _look_for(program: str) -> str:
    """The shell's words that print `program` when the image lacks it: a program on its
    PATH, or `import:MODULE`, a module its python3 imports."""
    said = shlex.quote(program)
    if program.startswith("import:"):
        module = program.removeprefix("import:")
        return f"python3 -c {shlex.quote(f'import {module}')} >/dev/null 2>&1 || echo {said};"
    return f"command -v {said} >/dev/null || echo {said};"


def _probe(engine: Engine, pinned: Pinned, programs: Sequence[str]) -> list[str]:
    script = " ".join(_look_for(p) for p in programs)
    answer = engine.run(
        "run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", pinned.image_id or pinned.ref,
        "-c", script, timeout_s=120,
    )  # fmt: skip
    if answer.returncode != 0:
        said = _last_line(answer.stderr)
        if re.search(r"no such file|not found|executable file", said, re.I):
            raise InvalidSpec(
                f"image: {pinned.ref!r} has no shell (/bin/sh) and its kind runs the job through"
                " one; add a shell to the image (busybox or a distribution's base)."
            )
        raise InvalidSpec(f"image: {pinned.ref!r} cannot be started here ({said[:300]}).")
    return [line.strip() for line in answer.stdout.splitlines() if line.strip()]


def user_of(wanted: str) -> str | None:
    """The engine's --user for image.user (None: the image's own)."""
    if wanted == "invoking":
        return f"{os.geteuid()}:{os.getegid()}"
    if wanted == "image":
        return None
    if wanted == "root":
        return "0:0"
    return wanted


@dataclass(frozen=True)
class RunArgs:
    """What `run_argv` puts on the engine's command line (never a secret's value: the
    environment passes by name, the engine reads each value from its own environment)."""

    name: str
    cluster: str
    image: str
    command: Sequence[str]
    env_names: Sequence[str]
    env_values: Mapping[str, str]  # never a secret's: the names an engine reads itself
    mounts: Sequence[str]  # folders mounted at the same path inside
    workdir: str
    user: str | None  # "uid:gid"; None: the image's own user
    gpus: Sequence[int]
    memory: int | None = None
    shm: int | None = None
    read_only: Sequence[str] = ()  # files or folders mounted read-only at the same path
    read_only_at: Mapping[str, str] = field(default_factory=dict)  # host folder: inside


def gpu_args(engine: Engine, gpus: Sequence[int]) -> list[str]:
    """The engine's arguments that give a container these host GPUs: CDI devices for
    podman (the NVIDIA Container Toolkit's spec), `--gpus` for docker."""
    if not gpus:
        return []
    if engine.name == "docker":
        return ["--gpus", f'"device={",".join(map(str, gpus))}"']
    kind = os.environ.get("GPUFLOW_CDI_KIND", CDI_GPU)
    return [arg for index in gpus for arg in ("--device", f"{kind}={index}")]


def run_argv(engine: Engine, args: RunArgs) -> list[str]:
    """The engine command that runs one unit: removed when it ends, labelled with its
    cluster, no engine socket, no new privileges, the host's network (the job reaches what
    it reached before), the workspace mounted at its own path."""
    argv = [
        "run", "--rm", "--name", args.name, "--label", f"{LABEL}={args.cluster}",
        "--network", "host", "--security-opt", "no-new-privileges", "--workdir", args.workdir,
    ]  # fmt: skip
    if args.user:
        argv += ["--user", args.user]
    for folder in args.mounts:
        argv += ["--volume", f"{folder}:{folder}"]
    for path in args.read_only:
        argv += ["--volume", f"{path}:{path}:ro"]
    for path, inside in args.read_only_at.items():
        argv += ["--volume", f"{path}:{inside}:ro"]
    for name in args.env_names:
        argv += ["--env", name]
    for name, value in args.env_values.items():
        argv += ["--env", f"{name}={value}"]
    argv += gpu_args(engine, args.gpus)
    if args.memory:
        argv += ["--memory", str(args.memory)]
    argv += ["--shm-size", str(args.shm or 1 << 30)]  # PyTorch's loaders want more than 64M
    return engine.argv(*argv, "--entrypoint", args.command[0], args.image, *args.command[1:])


def containers_of(engine: Engine, cluster: str | None = None) -> list[tuple[str, str]]:
    """Return (id, cluster) of the containers gpuflow made here (of one cluster)."""
    label = f"{LABEL}={cluster}" if cluster else LABEL
    answer = engine.run(
        "ps", "--all", "--filter", f"label={label}", "--format", "{{.ID}} {{.Labels}}", timeout_s=60
    )
    if answer.returncode != 0:
        return []
    found = []
    for line in answer.stdout.splitlines():
        ident, _, labels = line.partition(" ")
        match = re.search(rf"{re.escape(LABEL)}[:=]([\w.-]+)", labels)
        found.append((ident, match.group(1) if match else ""))
    return found


def remove(engine: Engine, cluster: str) -> int:
    """Remove every container of `cluster` (killed if running); return how many."""
    found = [ident for ident, _ in containers_of(engine, cluster)]
    if found:
        engine.run("rm", "--force", *found, timeout_s=120)
    return len(found)


def kill(engine: Engine, name: str, signal: str = "TERM") -> bool:
    """Send `signal` to a unit's container; False when it is not running."""
    return engine.run("kill", "--signal", signal, name, timeout_s=60).returncode == 0


# -- a registry asked for a digest (the orchestrator pins an image it does not run) ----------

_ACCEPT = ", ".join(
    [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)


def plain_http_registries() -> set[str]:
    """The registries this machine's engine settings mark insecure (plain HTTP):
    registries.conf's `[[registry]] insecure = true` (CONTAINERS_REGISTRIES_CONF, else
    /etc/containers/registries.conf)."""
    import tomllib

    path = Path(os.environ.get("CONTAINERS_REGISTRIES_CONF") or "/etc/containers/registries.conf")
    try:
        settings = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return {
        str(entry.get("location") or entry.get("prefix"))
        for entry in settings.get("registry", [])
        if isinstance(entry, dict) and entry.get("insecure")
    }


def _repository(ref: str) -> tuple[str, str, str]:
    """(registry host to ask, repository, tag) of a reference without a digest."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    last, _, tag = last.partition(":")
    path = f"{head}/{last}" if head else last
    registry = registry_of(path)
    repository = path.removeprefix(f"{registry}/") if registry != "docker.io" else path
    if registry == "docker.io":
        registry = "registry-1.docker.io"
        repository = repository if "/" in repository else f"library/{repository}"
    return registry, repository, tag or "latest"


def resolve_digest(
    ref: str,
    credentials: tuple[str | None, str | None] = (None, None),
    timeout_s: float = 30.0,
) -> str:
    """The digest the registry gives `ref` now (its manifest, or its index for a
    multi-platform image: what every host pulls by), asked without pulling; one sentence
    for a reference the registry does not have, refuses, or a registry that cannot be
    reached. Basic auth and the token flow (Bearer) registries use."""
    if "@" in ref:
        return ref.split("@", 1)[1]
    import urllib.error
    import urllib.request

    registry, repository, tag = _repository(ref)
    scheme = "http" if registry in plain_http_registries() else "https"
    url = f"{scheme}://{registry}/v2/{repository}/manifests/{tag}"
    username, password = credentials
    basic = (
        "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        if username and password
        else None
    )

    def ask(authorization: str | None) -> urllib.response.addinfourl:
        request = urllib.request.Request(url, method="HEAD", headers={"Accept": _ACCEPT})
        if authorization:
            request.add_header("Authorization", authorization)
        return urllib.request.urlopen(request, timeout=timeout_s)

    try:
        try:
            answer = ask(None)
        except urllib.error.HTTPError as exc:
            if exc.code != 401:
                raise
            challenge = exc.headers.get("WWW-Authenticate", "")
            answer = ask(_authorization(challenge, basic, repository, timeout_s))
    except urllib.error.HTTPError as exc:
        said = f"HTTP {exc.code} {exc.reason}"
        raise InvalidSpec(pull_failure(ref, said, basic is not None)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidSpec(pull_failure(ref, f"dial tcp {registry}: {reason}", False)) from None
    digest = answer.headers.get("Docker-Content-Digest", "")
    if not digest.startswith("sha256:"):
        raise InvalidSpec(
            f"image: the registry {registry} gave no digest for {ref!r}; give the image as"
            " name@sha256:... to pin it."
        )
    return digest


def _authorization(
    challenge: str, basic: str | None, repository: str, timeout_s: float
) -> str | None:
    """The Authorization a registry's 401 challenge asks for: Basic as it is, Bearer from
    its token service (with the credentials, where there are any)."""
    import urllib.parse
    import urllib.request

    scheme, _, params = challenge.partition(" ")
    if scheme.lower() == "basic":
        return basic
    if scheme.lower() != "bearer":
        return basic
    fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
    query = {"service": fields.get("service", ""), "scope": f"repository:{repository}:pull"}
    request = urllib.request.Request(f"{fields.get('realm', '')}?{urllib.parse.urlencode(query)}")
    if basic:
        request.add_header("Authorization", basic)
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        token = json.loads(answer.read() or b"{}")
    found = token.get("token") or token.get("access_token")
    return f"Bearer {found}" if found else None
