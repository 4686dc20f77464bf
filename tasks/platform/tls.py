"""Where the local platform listens, and its TLS when a team shares it on purpose.

`gpuflow platform up` listens on 127.0.0.1 by default: only this machine's users reach it,
and the auth string keeps out all but its own. `--listen ADDR` (an address of this host,
or 0.0.0.0 / :: for all of them) shares it with a team: then the server speaks TLS 1.3
only, with the certificate the user gives (`--tls-cert`, `--tls-key`) or one generated for
the host's names and addresses (kept 0600 under $GPUFLOW_HOME/platform/tls), and the auth
string still guards every request. A teammate sets PREFECT_API_URL, PREFECT_API_AUTH_STRING
and, for a generated certificate, PREFECT_API_SSL_CERT_FILE (docs/platform.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

import psutil
from pydantic import BaseModel

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import private_dir, write_atomic

EVERYWHERE = ("0.0.0.0", "::")
CERT_DAYS = 825  # what browsers still accept for a certificate's life


class Listening(BaseModel):
    """Where the platform's server listens and how it is reached."""

    bind: str = "127.0.0.1"  # the address the server binds
    local: str = "127.0.0.1"  # the address this host's own clients use
    shown: str = "127.0.0.1"  # the address the UI link names (a teammate's, when shared)
    cert: str | None = None  # the TLS certificate (PEM), None: plain HTTP on loopback
    key: str | None = None
    trust: str | None = None  # the file clients trust it by (a self-signed certificate)

    @property
    def shared(self) -> bool:
        """True when other machines reach it (not a loopback address)."""
        return not ipaddress.ip_address(self.bind).is_loopback

    @property
    def scheme(self) -> str:
        return "https" if self.cert else "http"

    def url(self, port: int, host: str | None = None) -> str:
        host = host or self.local
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def host_addresses() -> set[str]:
    """Return the IP addresses of this host's interfaces."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.add(address.address.split("%")[0])
    return found


def reachable_name() -> str:
    """Return the name (or address) another machine reaches this host by: its full name
    when that does not resolve to loopback here, else its first address that is not a
    loopback or link-local one (a name like `localhost` would send a teammate to their
    own machine)."""
    name = socket.getfqdn()
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError:
        resolved = set()
    if (
        name
        and resolved
        and not any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in resolved)
    ):
        return name
    usable = sorted(
        a for a in host_addresses()
        if not (ip := ipaddress.ip_address(a)).is_loopback and not ip.is_link_local
    )  # fmt: skip
    usable.sort(key=lambda a: ":" in a)  # IPv4 first: easier to type
    return usable[0] if usable else socket.gethostname()


def listening(listen: str, cert: Path | None, key: Path | None, tls_folder: Path) -> Listening:
    """Return where and how the platform listens, checked before anything starts
    (InvalidSpec, one sentence, naming the option); a certificate is generated in
    `tls_folder` when the platform is shared and none is given."""
    try:
        address = ipaddress.ip_address(listen.strip())
    except ValueError:
        raise InvalidSpec(
            f"--listen: {listen!r} is not an IP address; give one of this host's addresses,"
            " 0.0.0.0 for all of them, or leave it out (127.0.0.1: this machine only)."
        ) from None
    bind = str(address)
    if bind not in EVERYWHERE and not address.is_loopback and bind not in host_addresses():
        raise InvalidSpec(
            f"--listen: {bind} is not an address of this host; give one of"
            f" {', '.join(sorted(host_addresses()))}, or 0.0.0.0 for all of them."
        )
    if (cert is None) != (key is None):
        raise InvalidSpec(
            "--tls-cert and --tls-key go together: give the certificate and its private key,"
            " or neither (a certificate is then generated for this host)."
        )
    shared = not address.is_loopback
    local = "127.0.0.1" if bind in EVERYWHERE or address.is_loopback else bind
    shown = reachable_name() if bind in EVERYWHERE else bind
    if cert is not None and key is not None:
        _check_pair(cert, key)
        trust = str(cert.resolve()) if _self_signed(cert) else None
        return Listening(
            bind=bind, local=local, shown=shown if shared else local,
            cert=str(cert.resolve()), key=str(key.resolve()), trust=trust,
        )  # fmt: skip
    if not shared:
        return Listening(bind=bind, local=local, shown=local)
    made_cert, made_key = generate(tls_folder, bind)
    return Listening(
        bind=bind, local=local, shown=shown, cert=str(made_cert), key=str(made_key),
        trust=str(made_cert),
    )  # fmt: skip


def _check_pair(cert: Path, key: Path) -> None:
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise InvalidSpec(f"{option}: {path} is not a file; give the PEM file's path.")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError):
        raise InvalidSpec(
            f"--tls-cert / --tls-key: {cert} and {key} are not a PEM certificate and its"
            " private key; give the pair the certificate was issued for."
        ) from None


def _self_signed(cert: Path) -> bool:
    from cryptography import x509

    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    return loaded.issuer == loaded.subject


def generate(folder: Path, bind: str) -> tuple[Path, Path]:
    """Return a self-signed certificate and its key for this host (made once, kept 0600
    in `folder`; made anew when the host's addresses changed): its names, `localhost`,
    127.0.0.1 and the addresses it listens on."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    names = sorted({socket.gethostname(), socket.getfqdn(), "localhost"})
    addresses = {"127.0.0.1", "::1"} | (host_addresses() if bind in EVERYWHERE else {bind})
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    wanted = sorted(names) + sorted(addresses)
    marker = folder / "names"
    made = cert_path.is_file() and key_path.is_file() and marker.is_file()
    if made and marker.read_text().split() == wanted:
        return cert_path, key_path
    private_dir(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, socket.getfqdn()[:64])])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(addresses)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_atomic(key_path, pem_key.decode())
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
    write_atomic(marker, "\n".join(wanted) + "\n")
    return cert_path, key_path


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """Return the server's TLS context: TLS 1.3 only."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    return context


def client_context(trust: str | None) -> ssl.SSLContext | None:
    """Return the context this host's clients check the platform's certificate with (None:
    the system's default)."""
    return ssl.create_default_context(cafile=trust) if trust else None
