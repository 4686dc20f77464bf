"""JobSpec: every bad input gets one sentence naming the field and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import JobSpec, load_spec

CMD = {"kind": "command", "command": ["echo", "hi"]}

BAD = [
    (
        {"job": CMD, "placement": {"backend": "local", "market": "spot"}},
        "placement.market: a setting of ec2, alibaba and tencent placements, not of backend"
        " 'local'; remove it,"
        " or set backend: ec2",
    ),
    (
        {"job": CMD, "placement": {"backend": "ec2", "namespace": "gpu"}},
        "placement.namespace: a setting of kubernetes placements, not of backend 'ec2'",
    ),
    (
        {"job": CMD, "placement": {"backend": "kubernetes", "namespce": "gpu"}},
        "placement.namespce: unknown field; did you mean 'namespace'?",
    ),
    (
        {"job": CMD, "placement": {"backend": "ec2", "market": "spott"}},
        "placement.market: 'spott' is not one of spot, on-demand, spot-then-on-demand",
    ),
    (
        {"job": CMD, "placement": {"backend": "slurm", "workspace_root": " "}},
        "placement.workspace_root: is empty; give a folder",
    ),
    ({"job": CMD, "resources": {"gpus": -1}}, "resources.gpus must be at least 0"),
    (
        {"job": CMD, "resources": {"gpus": 0, "gpu_product": "H100"}},
        "resources.gpu_product is set but resources.gpus is 0",
    ),
    (
        {"job": CMD, "resources": {"gpus": 1, "gpu_product": "H900"}},
        "'H900' is not a known GPU product",
    ),
    ({"job": CMD, "resources": {"memory": "lots"}}, "resources.memory: 'lots' is not a size"),
    ({"job": CMD, "limits": {"max_duration": 0}}, "limits.max_duration must be more than 0"),
    (
        {"job": CMD, "limits": {"max_duration": "soon"}},
        "limits.max_duration: 'soon' is not a duration",
    ),
    (
        {"job": {"kind": "bake"}},
        "job.kind: 'bake' is not a job kind; use one of: command, matmul, train",
    ),
    (
        {"job": {"kind": "train"}},
        "job.dataset is required; add it. job.output is required; add it.",
    ),
    ({"job": {"command": ["x"]}}, "job.kind is required"),
    ({"job": {"kind": "command"}}, "job.command is required"),
    ({"job": {"kind": "command", "command": ""}}, "job.command: is empty"),
    (
        {"job": {**CMD, "copies": "many"}},
        "job.copies: input should be 'one', 'per_node' or 'per_gpu' (got 'many')",
    ),
    ({"job": CMD, "resourcs": {"gpus": 1}}, "resourcs: unknown field; did you mean 'resources'?"),
    ({"job": CMD, "resources": {"gpu": 1}}, "resources.gpu: unknown field; did you mean 'gpus'?"),
    ({"job": {**CMD, "comand": "x"}}, "job.comand: unknown field; did you mean 'command'?"),
    ({"job": CMD, "name": "My Job"}, "name: 'My Job' is not a valid name"),
    ({"job": CMD, "env": {"1BAD": "x"}}, "env: '1BAD' is not an environment variable name"),
    ({"job": CMD, "name": "x-"}, "starting and ending with a letter or digit"),
    ({"job": CMD, "name": "-lead"}, "starting and ending with a letter or digit"),
    (
        {"job": CMD, "env": {f"V{i}": "x" * 100_000 for i in range(12)}},
        "env: the variables hold 1172 KiB in all, over 1024 KiB",
    ),
    (
        {"job": CMD, "env": {"GPUFLOW_OUTPUT_DIR": "/etc"}},
        "env: GPUFLOW_OUTPUT_DIR is set by gpuflow for every unit",
    ),
    ({"job": CMD, "limits": {"max_cost_usd": -5}}, "limits.max_cost_usd must be more than 0"),
    ({"job": CMD, "metrics": {"pushgateway": "localhost:9091"}}, "metrics.pushgateway"),
    (
        {"job": CMD, "storage": {"artifacts": "s3://b/p"}},
        "storage.artifacts: s3:// artifacts are not supported",
    ),
    ({"job": CMD, "env": {"T": "a"}, "secret_env": {"T": "b"}}, "T is in both env and secret_env"),
    ({"job": CMD, "env": {"N": 4}}, 'env.N: environment values are text; quote it, e.g. N: "4"'),
    ({"job": CMD, "limits": {"max_duration": 1e400}}, "limits.max_duration: inf is not a finite"),
    ({"job": CMD, "limits": {"max_duration": "1e400"}}, "'1e400' is not a finite duration"),
    (
        {"job": CMD, "storage": {"artifacts": "file:///x/../../etc/y"}},
        "storage.artifacts: 'file:///x/../../etc/y' climbs out of its folder with '..'",
    ),
    (
        {"job": {"kind": "render", "scene": "/s.blend", "output": "file:///o/../../etc"}},
        "climbs out of its folder with '..'",
    ),
    ({"job": CMD, "resources": {"gpus": True}}, "resources.gpus: input should be a valid integer"),
    ({"job": CMD, "resources": {"nodes": True}}, "resources.nodes: input should be a valid"),
    (
        {"job": {"kind": "command", "command": ["echo", "a\x00b"]}},
        "job.command: word 2 holds a NUL byte, which no program can receive; remove it",
    ),
    (
        {"job": {"kind": "command", "command": ["echo", "x" * 200_000]}},
        "job.command: word 2 is 195 KiB; Linux passes at most 128 KiB in one argument",
    ),
    (
        {"job": CMD, "env": {"BIG": "x" * 200_000}},
        "env: the value of BIG is 195 KiB; Linux passes at most 128 KiB in one environment",
    ),
    (
        {
            "job": CMD,
            "placement": [{"backend": "local", "workspace_root": f"/w/{i}"} for i in range(1000)],
        },
        "placement: 1000 candidates; a placement list holds at most 16",
    ),
    # a one-string command with shell syntax is refused, never run as split words
    (
        {"job": {"kind": "command", "command": "echo hi; echo there"}},
        "job.command: holds the shell syntax ';', but a command runs without a shell; give it"
        ' as a list of words, or run a shell on purpose: [sh, -c, "echo hi; echo there"]',
    ),
    ({"job": {"kind": "command", "command": "make && ./run"}}, "shell syntax '&&'"),
    ({"job": {"kind": "command", "command": "cat a | wc"}}, "shell syntax '|'"),
    ({"job": {"kind": "command", "command": "echo x > out"}}, "shell syntax '>'"),
    ({"job": {"kind": "command", "command": "echo $HOME"}}, "shell syntax '$HOME'"),
    ({"job": {"kind": "command", "command": "echo `id`"}}, "shell syntax '`id`'"),
    ({"job": {"kind": "command", "command": "sleep 9 &"}}, "shell syntax '&'"),
    (
        {"job": {"kind": "hpc", "ranks": 1, "program": ["true"], "build": "make; exit 3"}},
        "job.build: holds the shell syntax ';'",
    ),
]


@pytest.mark.parametrize(
    ("line", "argv"),
    [
        ('echo "a;b" x', ["echo", "a;b", "x"]),
        ("echo '$HOME'", ["echo", "$HOME"]),
        ('python -c "print(1)"', ["python", "-c", "print(1)"]),
        ("train.py --lr 1e-3", ["train.py", "--lr", "1e-3"]),
    ],
)
def test_quoted_shell_characters_stay_words(line, argv):
    spec = load_spec({"job": {"kind": "command", "command": line}})
    assert spec.job.command == argv


@pytest.mark.parametrize(("raw", "expected"), BAD)
def test_bad_input_names_field_and_fix(raw, expected):
    with pytest.raises(InvalidSpec) as caught:
        load_spec(raw)
    message = str(caught.value)
    assert expected in message
    assert "Traceback" not in message and "pydantic" not in message.lower()


def test_env_values_are_never_echoed_in_errors():
    with pytest.raises(InvalidSpec) as caught:
        load_spec({"job": CMD, "env": {"TOKEN": 12345}})
    assert "12345" not in str(caught.value)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("- kind: command\n- command: [echo]\n")
    with pytest.raises(InvalidSpec, match="top level must be a mapping"):
        load_spec(path)


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("job:\n  kind: command\n  command: [echo\n")
    with pytest.raises(InvalidSpec, match="not valid YAML at line"):
        load_spec(path)


# "billion laughs": nine levels of nine aliases, 9**9 values once expanded
BOMB = (
    "name: bomb\njob: {kind: train, dataset: 'file:///d', output: 'file:///o',"
    " model: 'torch.nn:Identity', model_args: {x: *l9}}\n"
)
BOMB = (
    "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
    + BOMB
)

SPEC_FILES = {
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00", "is not a text file (not UTF-8)"),
    "not utf-8": ("job: {kind: command, command: [caf\xe9]}\n".encode("latin-1"), "not UTF-8"),
    "nested 5,000 levels": (("a: " + "[" * 5000 + "]" * 5000).encode(), "nested too deeply"),
    "duplicate key": (
        b"job: {kind: command, command: [true]}\nname: a\nname: b\n",
        "the key 'name' appears twice (lines 2 and 3); keep one of them",
    ),
    "duplicate nested key": (
        b"job:\n  kind: command\n  kind: matmul\n",
        "the key 'kind' appears twice (lines 2 and 3)",
    ),
    "alias bomb": (BOMB.encode(), "its aliases (*name) expand to more than 200,000 values"),
    "alias into itself": (b"job: &j {kind: command, command: [*j]}\n", "refers to the value"),
}


@pytest.mark.parametrize("case", list(SPEC_FILES))
def test_spec_files_that_cannot_be_read_are_named(case, tmp_path):
    data, expected = SPEC_FILES[case]
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    with pytest.raises(InvalidSpec) as caught:
        load_spec(path)
    assert str(caught.value).startswith(f"{path}: ") and expected in str(caught.value)


def test_a_folder_is_not_called_missing(tmp_path):
    with pytest.raises(InvalidSpec, match="is a folder; give the path of a job YAML"):
        load_spec(tmp_path)


def test_missing_file():
    with pytest.raises(InvalidSpec, match="no such file"):
        load_spec("/nonexistent/job.yaml")


def test_merge_keys_and_small_aliases_still_read(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "job: {kind: command, command: [true]}\n"
        "env: {<<: &env {A: '1', B: '2'}, B: '3'}\n"
        "job_env: [*env, *env]\n"
    )
    with pytest.raises(InvalidSpec, match="job_env"):  # an unknown field, not a YAML error
        load_spec(path)
    path.write_text(path.read_text().replace("job_env: [*env, *env]\n", ""))
    spec = load_spec(path)
    assert spec.env == {"A": "1", "B": "3"}


def test_loads_yaml_with_units_and_aliases(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: train-1\njob: {kind: command, command: 'python train.py --lr 0.1'}\n"
        "resources: {gpus: 2, gpu_product: h100, memory: 16Gi, disk: 50GB, shm: 8Gi}\n"
        "limits: {max_duration: 1h30m, max_cost_usd: 20}\n"
        "retry: {provision: {retries: 5, delay_s: 1}}\n"
    )
    spec = load_spec(path)
    assert spec.job.command == ["python", "train.py", "--lr", "0.1"]
    assert spec.resources.gpu_product == "NVIDIA-H100-80GB-HBM3"
    assert spec.resources.memory == 16 * 2**30
    assert spec.resources.disk == 50 * 10**9
    assert spec.limits.max_duration == 5400
    assert spec.retry.provision.retries == 5
    assert spec.retry.run.retries == 3  # default kept


def test_json_and_dict_round_trip():
    spec = load_spec({"job": {"kind": "matmul", "size": 512}})
    assert load_spec(spec.model_dump()) == spec
    assert load_spec(spec) is spec
    assert JobSpec.model_json_schema()["properties"]["job"]


def test_yaml_scalars_in_command_become_strings(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "job: {kind: command, command: [python, train.py, --epochs, 10, --lr, 0.5, --fp16, true]}\n"
    )
    assert load_spec(path).job.command == [
        "python",
        "train.py",
        "--epochs",
        "10",
        "--lr",
        "0.5",
        "--fp16",
        "true",
    ]


def test_an_env_value_with_a_nul_byte_is_refused_without_echoing_it():
    with pytest.raises(InvalidSpec) as caught:
        load_spec({"job": CMD, "env": {"TOKEN": "se\0cret"}})
    assert "TOKEN holds a NUL byte" in str(caught.value)
    assert "cret" not in str(caught.value)


def test_special_files_are_named_as_such(tmp_path):
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null"), Path("/dev/zero")):
        with pytest.raises(InvalidSpec, match="is not a regular file"):
            load_spec(path)


def test_a_placement_is_read_as_its_backends_model():
    from gpuflow import Ec2Placement, KubernetesPlacement, LocalPlacement, Placement

    spec = load_spec({"job": CMD})
    assert type(spec.placement) is LocalPlacement and spec.placement.workspace_root is None
    spec = load_spec({"job": CMD, "placement": [{"backend": "ec2"}, {"backend": "kubernetes"}]})
    assert [type(c) for c in spec.candidates] == [Ec2Placement, KubernetesPlacement]
    assert spec.placement.market == "spot-then-on-demand"
    # built in Python with the shared fields only: read as its backend's, the value kept
    spec = JobSpec(job=CMD, placement=Placement(backend="kubernetes", gpu_wait=60))
    assert type(spec.placement) is KubernetesPlacement and spec.placement.gpu_wait == 60
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_the_base_placement_names_the_model_of_a_backends_own_setting():
    from gpuflow import InvalidSpec as Public
    from gpuflow import Placement

    with pytest.raises(
        Public, match="namespace: a setting of kubernetes placements; build KubernetesPlacement"
    ):
        Placement(backend="kubernetes", namespace="gpu")
