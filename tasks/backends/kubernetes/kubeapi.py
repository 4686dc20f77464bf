"""A small synchronous client for the Kubernetes API: the credentials kubectl would use, and
requests whose failures come back as one sentence (an RBAC refusal names the verb and the
resource; an unreachable server names the address and the cause).

Credentials, in kubectl's order: an explicit kubeconfig (a block's), else $KUBECONFIG (the
first file that exists), else ~/.kube/config, else the pod's service account (in-cluster).
Client certificates, bearer tokens and exec credential plugins (EKS, GKE) are supported.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, SecretStr

from gpuflow.tasks import yamlfile
from gpuflow.tasks.errors import GpuflowError, InvalidSpec, Unreachable

IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IDEMPOTENT = {"GET", "PUT", "DELETE"}
# how long a server that answers 429 (too many requests, storage initializing) is asked again
BUSY_WAIT_S = 30.0
VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class KubeError(GpuflowError):
    """The API server refused a request; `status` and `reason` say how."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class KubeUnreachable(Unreachable):
    """The API server did not answer."""


class KubeConfig(BaseModel):
    """Where the API server is and how to prove who we are."""

    server: str
    namespace: str = "default"
    source: str  # where these credentials came from, for messages
    ca_pem: str | None = None
    insecure: bool = False
    cert_pem: str | None = None
    key_pem: SecretStr | None = None
    token: SecretStr | None = None
    exec_command: list[str] | None = None
    exec_env: dict[str, str] = {}


def load_config(kubeconfig: dict[str, Any] | None = None, context: str | None = None) -> KubeConfig:
    """Return the credentials to use: `kubeconfig` (a parsed file, from a block), else
    kubectl's own resolution. InvalidSpec says what is missing."""
    if kubeconfig is not None:
        return _from_kubeconfig(kubeconfig, context, "the cluster-config block")
    paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    paths.append(str(Path.home() / ".kube" / "config"))
    for path in paths:
        if Path(path).is_file():
            loaded = yamlfile.read(Path(path), "a kubeconfig")  # one sentence if unreadable
            if loaded is not None and not isinstance(loaded, dict):
                raise InvalidSpec(f"{path}: is not a kubeconfig (no mapping at the top); fix it.")
            return _from_kubeconfig(loaded or {}, context, path)
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if host and port and (IN_CLUSTER / "token").is_file():
        return KubeConfig(
            server=f"https://{host}:{port}",
            namespace=(IN_CLUSTER / "namespace").read_text().strip(),
            source="this pod's service account",
            ca_pem=(IN_CLUSTER / "ca.crt").read_text(),
            token=SecretStr((IN_CLUSTER / "token").read_text().strip()),
        )
    raise InvalidSpec(
        "placement: no Kubernetes credentials were found (no KUBECONFIG, no ~/.kube/config,"
        " not in a pod); name a KubernetesGpuPool block in placement.block or set KUBECONFIG."
    )


def _from_kubeconfig(doc: dict[str, Any], context: str | None, source: str) -> KubeConfig:
    def named(section: str, name: str | None) -> dict[str, Any]:
        for entry in doc.get(section) or []:
            if entry.get("name") == name:
                return entry.get(section[:-1]) or {}
        raise InvalidSpec(f"the kubeconfig {source} has no {section[:-1]} named {name!r}; fix it")

    chosen = context or doc.get("current-context")
    if not chosen:
        raise InvalidSpec(f"the kubeconfig {source} names no current-context; set one")
    ctx = named("contexts", chosen)
    cluster, user = named("clusters", ctx.get("cluster")), named("users", ctx.get("user"))
    if not cluster.get("server"):
        raise InvalidSpec(f"the kubeconfig {source}: cluster of context {chosen!r} has no server")

    def pem(data_key: str, file_key: str, where: dict[str, Any]) -> str | None:
        if where.get(data_key):
            return base64.b64decode(where[data_key]).decode()
        return Path(where[file_key]).expanduser().read_text() if where.get(file_key) else None

    exec_spec = user.get("exec") or {}
    key = pem("client-key-data", "client-key", user)
    token = user.get("token") or (
        Path(user["tokenFile"]).read_text().strip() if user.get("tokenFile") else None
    )
    return KubeConfig(
        server=cluster["server"].rstrip("/"),
        namespace=ctx.get("namespace") or "default",
        source=source,
        ca_pem=pem("certificate-authority-data", "certificate-authority", cluster),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert_pem=pem("client-certificate-data", "client-certificate", user),
        key_pem=SecretStr(key) if key else None,
        token=SecretStr(token) if token else None,
        exec_command=[exec_spec["command"], *exec_spec.get("args", [])] if exec_spec else None,
        exec_env={e["name"]: e["value"] for e in exec_spec.get("env") or []},
    )


class KubeApi:
    """Requests to one API server, as one identity."""

    def __init__(self, config: KubeConfig, timeout_s: float = 15.0) -> None:
        self.config = config
        self.namespace = config.namespace
        headers = {"Accept": "application/json"}
        token = config.token.get_secret_value() if config.token else None
        cert_pem, key_pem = (
            config.cert_pem,
            config.key_pem.get_secret_value() if config.key_pem else None,
        )
        if config.exec_command:
            token, cert_pem, key_pem = self._exec_credential(token, cert_pem, key_pem)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        context = ssl.create_default_context()
        if config.insecure:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        elif config.ca_pem:
            context = ssl.create_default_context(cadata=config.ca_pem)
        if cert_pem and key_pem:
            # ssl loads a client certificate only from files: private, removed at once
            with tempfile.TemporaryDirectory(prefix="gpuflow-kube-") as folder:
                cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
                cert.write_text(cert_pem)
                key.touch(mode=0o600)
                key.write_text(key_pem)
                context.load_cert_chain(cert, key)
        self.http = httpx.Client(
            base_url=config.server,
            headers=headers,
            verify=context,
            timeout=timeout_s,
            # one log stream per running unit on top of the requests: room for many units
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=50),
        )

    def _exec_credential(self, token, cert, key) -> tuple[Any, Any, Any]:
        assert self.config.exec_command is not None
        try:
            done = subprocess.run(
                self.config.exec_command,
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, **self.config.exec_env},
            )
            status = json.loads(done.stdout).get("status") or {}
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            raise InvalidSpec(
                f"the kubeconfig's credential plugin {self.config.exec_command[0]!r} failed"
                f" ({type(exc).__name__}); run it by hand to see why."
            ) from None
        return (
            status.get("token", token),
            status.get("clientCertificateData", cert),
            status.get("clientKeyData", key),
        )

    def close(self) -> None:
        self.http.close()

    def request(
        self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Return the decoded answer; KubeError (one sentence) when the server refuses,
        KubeUnreachable when it does not answer."""
        attempts = 3 if method in IDEMPOTENT else 1
        busy_until = time.monotonic() + BUSY_WAIT_S
        attempt = 0
        while True:
            try:
                answer = self.http.request(method, path, json=body, params=params)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                attempt += 1
                if attempt < attempts:  # a kept-alive connection the server just closed
                    time.sleep(0.2 * attempt)
                    continue
                raise self._unreachable(exc) from None
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from None
            # 429: the server did not take the request (too many, or a server just started
            # whose storage is still initializing) and says when to ask again; as
            # client-go does, any method is asked again, within BUSY_WAIT_S
            if answer.status_code == 429 and time.monotonic() < busy_until:
                time.sleep(_retry_after(answer))
                continue
            break
        if answer.status_code < 400:
            return answer.json() if answer.content else {}
        raise refusal(method, path, answer)

    def _unreachable(self, exc: httpx.HTTPError) -> KubeUnreachable:
        return KubeUnreachable(
            f"the Kubernetes API server {self.config.server} (from {self.config.source})"
            f" did not answer: {exc or type(exc).__name__}."
        )

    def stream(self, path: str, params: dict[str, Any]) -> Iterator[str]:
        """Yield the lines of a streamed answer (pod logs) until the server ends it; one that
        follows may be quiet for as long as its pod is, one that does not may not."""
        timeout = None if params.get("follow") == "true" else self.http.timeout
        with self.http.stream("GET", path, params=params, timeout=timeout) as answer:
            if answer.status_code >= 400:
                answer.read()
                raise refusal("GET", path, answer)
            yield from answer.iter_lines()


def _retry_after(answer: httpx.Response) -> float:
    """Return how long to wait before asking again: the server's Retry-After, 1 s to 5 s."""
    try:
        return min(5.0, max(1.0, float(answer.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def refusal(method: str, path: str, answer: httpx.Response) -> KubeError:
    """Return the API server's refusal as one sentence."""
    try:
        status = answer.json()
    except ValueError:
        status = {}
    reason, message = status.get("reason", ""), status.get("message", answer.text[:300])
    details = status.get("details") or {}
    if answer.status_code == 403:
        resource = details.get("kind") or _resource_of(path)
        namespace = _namespace_of(path)
        where = f" in namespace {namespace}" if namespace else ""
        return KubeError(
            f"Kubernetes refused to {VERBS.get(method, method.lower())} {resource}{where} for"
            f" these credentials (RBAC: {message}); grant that verb in the Role gpuflow runs"
            " with (infra/kubernetes) or use other credentials.",
            403,
            reason,
        )
    if answer.status_code == 401:
        return KubeError(
            f"Kubernetes did not accept these credentials ({message}); renew them.", 401, reason
        )
    return KubeError(
        f"Kubernetes said {answer.status_code} {reason}: {message}", answer.status_code, reason
    )


def _resource_of(path: str) -> str:
    parts = [p for p in path.split("?")[0].split("/") if p]
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        return parts[parts.index("namespaces") + 2]
    return parts[-1] if parts else path


def _namespace_of(path: str) -> str | None:
    parts = [p for p in path.split("/") if p]
    return (
        parts[parts.index("namespaces") + 1]
        if "namespaces" in parts and len(parts) > parts.index("namespaces") + 1
        else None
    )
