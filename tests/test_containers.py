"""tasks/containers.py and the spec's image: without an engine: the command a unit runs
(no secret's value on it), what a failed pull says, engines found or refused."""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from gpuflow.tasks import containers
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import JobSpec, load_spec

PODMAN = containers.Engine("podman", "/usr/bin/podman")
DOCKER = containers.Engine("docker", "/usr/bin/docker")


def _args(**over) -> containers.RunArgs:
    given = dict(
        name="gpuflow-r-main-abc",
        cluster="gpuflow-r",
        image="sha256:1234",
        command=["python3", "train.py"],
        env_names=["TOKEN", "GPUFLOW_OUTPUT_DIR"],
        env_values={"HOME": "/home/job"},
        mounts=["/ws", "/tmp/job"],
        workdir="/ws",
        user="1000:1000",
        gpus=[2, 5],
    )
    return containers.RunArgs(**{**given, **over})


def test_a_unit_passes_its_environment_by_name_never_by_value():
    argv = containers.run_argv(PODMAN, _args())
    assert argv[argv.index("--env") + 1] == "TOKEN"  # the engine reads the value itself
    assert "HOME=/home/job" in argv and not any(a.startswith("TOKEN=") for a in argv)
    assert argv[argv.index("--entrypoint") + 1 : argv.index("--entrypoint") + 4] == [
        "python3",
        "sha256:1234",
        "train.py",
    ]
    assert [a for i, a in enumerate(argv) if a == "--device" or argv[i - 1] == "--device"] == [
        "--device",
        "nvidia.com/gpu=2",
        "--device",
        "nvidia.com/gpu=5",
    ]
    assert argv[argv.index("--user") + 1] == "1000:1000"
    assert argv[argv.index("--label") + 1] == f"{containers.LABEL}=gpuflow-r"
    assert "--privileged" not in argv and not any("docker.sock" in a for a in argv)
    assert argv[argv.index("--security-opt") + 1] == "no-new-privileges"


def test_docker_gets_its_gpus_flag_and_the_image_user_when_asked():
    argv = containers.run_argv(DOCKER, _args(user=None))
    assert argv[argv.index("--gpus") + 1] == '"device=2,5"'
    assert "--user" not in argv and "--device" not in argv


@pytest.mark.parametrize(
    "said, creds, sentence",
    [
        ("reading manifest 1 in r/x: unauthorized", False, "name a RegistryCredentials block"),
        ("unauthorized: authentication required", True, "check the user and password"),
        ("reading manifest 1 in r/x: manifest unknown", False, "the registry has no such image"),
        ("name unknown: Unknown name", False, "the registry has no such image"),
        ("dial tcp 10.0.0.9:443: i/o timeout", False, "could not be reached"),
        ("http: server gave HTTP response to HTTPS client", False, "marked insecure"),
        ("writing blob: no space left on device", False, "no space left to unpack it"),
        ("something odd", False, "cannot be pulled (something odd); check the reference"),
    ],
)
def test_a_failed_pull_is_one_sentence_with_its_cause(said, creds, sentence):
    text = containers.pull_failure("r.example/x:1", f"Trying...\nError: {said}", creds)
    assert text.startswith("image: 'r.example/x:1' cannot be pulled") and sentence in text
    assert text.count("\n") == 0


def _program(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_docker_client_without_its_daemon_is_no_engine(tmp_path):
    _program(tmp_path, "docker", 'echo "Cannot connect to the Docker daemon" >&2; exit 1')
    with pytest.raises(InvalidSpec) as caught:
        containers.find_engine(path=str(tmp_path))
    said = str(caught.value)
    assert "docker is installed but Cannot connect to the Docker daemon" in said
    assert "install podman (apt-get install podman) or docker" in said
    _program(tmp_path, "podman", "exit 0")
    assert containers.find_engine(path=str(tmp_path)).name == "podman"


def test_the_registry_of_a_reference():
    assert containers.registry_of("ghcr.io/team/x:1") == "ghcr.io"
    assert containers.registry_of("127.0.0.1:5000/x") == "127.0.0.1:5000"
    assert containers.registry_of("localhost/x") == "localhost"
    assert containers.registry_of("team/x") == "docker.io"


def test_the_login_file_is_private_and_gone_after(tmp_path):
    with containers.auth_file("r.example", "me", "pw-123") as folder:
        assert folder is not None
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(f"{folder}/config.json").st_mode) == 0o600
    assert not os.path.exists(folder)


def _spec(text: str) -> JobSpec:
    return load_spec(yaml.safe_load(text))


def test_image_is_a_reference_or_a_mapping():
    short = _spec("image: ghcr.io/team/x:1\njob: {kind: command, command: [true]}\n")
    assert short.image is not None and short.image.ref == "ghcr.io/team/x:1"
    assert short.image.user == "invoking" and short.image.pinned == "ghcr.io/team/x:1"
    digest = "sha256:" + "a" * 64
    pinned = short.image.model_copy(update={"digest": digest})
    assert pinned.pinned == f"ghcr.io/team/x@{digest}"  # engines refuse a tag beside it
    port = pinned.model_copy(update={"ref": "r:5000/x:2"})
    assert port.pinned == f"r:5000/x@{digest}"


@pytest.mark.parametrize(
    "image, said",
    [
        ("ghcr.io/Team/x:1", "its path must be lower case"),
        ("ghcr.io/team/x:1@sha256:abc", "is not an image reference"),
        ("{ref: 'x:1', user: admin}", "'admin' is not a user"),
        ("{ref: 'x:1', pull: sometimes}", "image.pull"),
        ("{ref: 'x:1', digest: 'md5:12'}", "is not a sha256 digest"),
    ],
)
def test_a_bad_image_field_is_one_sentence(image, said):
    with pytest.raises(InvalidSpec) as caught:
        _spec(f"image: {image}\njob: {{kind: command, command: [true]}}\n")
    assert said in str(caught.value)


def test_image_and_the_deprecated_placement_image_must_agree():
    with pytest.raises(InvalidSpec) as caught:
        _spec(
            "image: ghcr.io/team/x:1\njob: {kind: command, command: [true]}\n"
            "placement: {backend: kubernetes, image: ghcr.io/team/y:2}\n"
        )
    said = str(caught.value)
    assert "placement.image is 'ghcr.io/team/y:2'" in said and "remove placement.image" in said
    same = _spec(
        "image: ghcr.io/team/x:1\njob: {kind: command, command: [true]}\n"
        "placement: {backend: kubernetes, image: ghcr.io/team/x:1}\n"
    )
    assert same.image is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a folder to another user needs root")
def test_a_slurm_image_folder_another_user_owns_is_refused(tmp_path):
    """In a workspace root others can write to, what another user put under
    .gpuflow-images first (a bundle, a library) would run as the job: refused."""
    import pwd

    from gpuflow.tasks.backends.slurm import oci
    from gpuflow.tasks.backends.slurm.commands import LocalClient

    nobody = pwd.getpwnam("nobody")
    root = tmp_path / "shared"
    planted = root / oci.IMAGES / "lib-0123"
    planted.mkdir(parents=True)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(InvalidSpec) as refused:
        oci._check_owned(LocalClient(), str(root), str(planted))
    assert f"placement.workspace_root: {planted} belongs to another user" in str(refused.value)
    os.chown(root / oci.IMAGES, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(InvalidSpec, match="belongs to another user"):
        oci._check_owned(LocalClient(), str(root), str(root / oci.IMAGES / "lib-other"))
    os.chown(root / oci.IMAGES, os.geteuid(), os.getegid())
    oci._check_owned(LocalClient(), str(root), str(root / oci.IMAGES / "lib-mine"))  # passes
