"""Pure logic, table-driven: units, GPU products, compatibility, cost, Prometheus text."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuflow.tasks import compat
from gpuflow.tasks.gpus import canonical_product, product_from_ec2, product_from_nvml_name
from gpuflow.tasks.metrics.cost import PriceTable, budget_seconds, run_cost
from gpuflow.tasks.metrics.prometheus import exposition
from gpuflow.tasks.metrics.summary import summarise
from gpuflow.tasks.units import parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16Gi", 16 * 2**30),
        ("512Mi", 512 * 2**20),
        ("100GB", 100 * 10**9),
        (1024, 1024),
        ("1.5G", 1_500_000_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12Qb", "", True, -1])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", 90), ("30m", 1800), ("1h30m", 5400), ("2d", 172800), (15, 15), ("250ms", 0.25)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["soon", "1x", "h", "1h 2"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("H100", "NVIDIA-H100-80GB-HBM3"),
        ("a100-80gb", "NVIDIA-A100-SXM4-80GB"),
        ("T4", "Tesla-T4"),
        ("NVIDIA-L4", "NVIDIA-L4"),
    ],
)
def test_canonical_product(name, label):
    assert canonical_product(name) == label


def test_nvml_names_map_to_node_labels():
    assert product_from_nvml_name("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert product_from_nvml_name("NVIDIA H200") == "NVIDIA-H200"
    assert product_from_nvml_name("Some Future GPU") == "Some-Future-GPU"


@pytest.mark.parametrize(
    ("torch_cuda", "driver_cuda", "driver", "level", "words"),
    [
        ("12.1", "11.8", "520.61.05", "fail", "upgrade the NVIDIA driver to 530.30.02"),
        ("12.8", "12.4", "550.54.14", "warn", "minor-version compatibility"),
        ("12.4", "12.8", "570.26", "pass", "runs on driver"),
        ("12.4", "12.4", "550.54.14", "pass", "runs on driver"),
        ("13.0", "12.9", "575.51.03", "fail", "580.65.06"),
        (None, "12.4", "550.54.14", "warn", "CPU-only build"),
        ("12.4", None, None, "warn", "no NVIDIA driver"),
    ],
)
def test_compatibility_table(torch_cuda, driver_cuda, driver, level, words):
    finding = compat.check(torch_cuda, driver_cuda, driver)
    assert finding.level == level
    assert words in finding.message


@pytest.mark.parametrize(
    ("version", "cuda"),
    [("2.13.0+cu128", "12.8"), ("2.4.1+cu121", "12.1"), ("2.13.0+cpu", None), ("2.13.0", None)],
)
def test_cuda_from_torch_version(version, cuda):
    assert compat.cuda_from_torch_version(version) == cuda


def test_nvml_cuda_version():
    assert compat.cuda_from_nvml(12040) == "12.4"
    assert compat.cuda_from_nvml(11080) == "11.8"


def test_cost_and_budget():
    table = PriceTable()
    cost = run_cost(table, "ec2", ["NVIDIA-H100-80GB-HBM3"] * 2, 0, 100 * 10**9, 1800)
    assert cost.breakdown["gpu"] == pytest.approx(12.29)
    assert cost.breakdown["disk"] == pytest.approx(100 * 0.08 / 730 / 2)
    assert cost.usd == pytest.approx(sum(cost.breakdown.values()))
    assert budget_seconds(12.29, 24.58) == pytest.approx(1800)
    assert budget_seconds(None, 10) is None
    assert budget_seconds(5, 0) is None
    assert run_cost(table, "local", [], 4, 10**9, 3600).usd == 0


def _sample(t, util, energy):
    gpu = {
        "gpu": 0,
        "UUID": "GPU-1",
        "modelName": 'NVIDIA "H100"',
        "DCGM_FI_DEV_GPU_UTIL": util,
        "DCGM_FI_DEV_FB_USED": 1000.0 + util,
        "DCGM_FI_DEV_POWER_USAGE": 300.0,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": energy,
    }
    return {
        "t": t,
        "Hostname": "h1",
        "host": {"cpu_percent": 50.0, "memory_used_bytes": 10},
        "gpus": [gpu],
    }


def test_summary_uses_energy_counter_and_gpu_hours():
    samples = [_sample(0, 50, 1_000_000), _sample(10, 100, 4_000_000)]
    cost = run_cost(PriceTable(), "ec2", ["NVIDIA-H100-80GB-HBM3"], 0, 0, 3600)
    metrics = summarise(samples, 3600, 1, cost)
    assert metrics.gpu_util_mean == 75 and metrics.gpu_util_max == 100
    assert metrics.gpu_memory_peak_mib == 1100
    assert metrics.energy_j == pytest.approx(3000)
    assert metrics.gpu_hours == 1 and metrics.gpu_seen
    assert metrics.cost_usd == pytest.approx(12.29)


def test_idle_gpu_hours_are_the_share_of_readings_under_the_threshold():
    samples = [_sample(t, util, 1_000_000 + t) for t, util in enumerate([0, 2, 50, 90])]
    cost = run_cost(PriceTable(), "local", [], 0, 0, 7200)
    assert summarise(samples, 7200, 2, cost).gpu_hours_idle == pytest.approx(2.0)  # 2 of 4
    assert summarise(samples, 7200, 2, cost, idle_pct=60).gpu_hours_idle == pytest.approx(3.0)


def test_summary_without_gpus_says_so():
    samples = [
        {"t": 0, "Hostname": "h", "host": {"cpu_percent": 10.0, "memory_used_bytes": 5}, "gpus": []}
    ]
    metrics = summarise(samples, 5, 0, run_cost(PriceTable(), "local", [], 1, 0, 5))
    assert not metrics.gpu_seen and "no GPU was seen" in metrics.note
    assert metrics.energy_j is None and metrics.gpu_util_mean is None


def test_exposition_is_valid_prometheus_text_with_dcgm_names_and_labels():
    samples = [_sample(0, 50, 1_000_000), _sample(10, 100, 4_000_000)]
    metrics = summarise(samples, 10, 1, run_cost(PriceTable(), "local", [], 1, 0, 10))
    text = exposition(samples[-1], metrics, "run-1", "smoke")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    util = families["DCGM_FI_DEV_GPU_UTIL"].samples[0]
    assert util.value == 100
    assert util.labels == {
        "gpu": "0",
        "UUID": "GPU-1",
        "modelName": 'NVIDIA "H100"',
        "Hostname": "h1",
        "flow_run_id": "run-1",
        "job": "smoke",
    }
    assert families["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"
    assert families["gpuflow_run_duration_seconds"].samples[0].value == 10


@pytest.mark.parametrize(
    ("name", "memory_mib", "label"),
    [
        ("T4", 16384, "Tesla-T4"),
        ("A10G", 22888, "NVIDIA-A10G"),
        ("V100", 16384, "Tesla-V100-SXM2-16GB"),
        ("V100", 32768, "Tesla-V100-SXM2-32GB"),  # p3dn: the 32 GB part
        ("A100", 40960, "NVIDIA-A100-SXM4-40GB"),
        ("A100", 81920, "NVIDIA-A100-SXM4-80GB"),  # p4de
        ("H100", 81920, "NVIDIA-H100-80GB-HBM3"),
        ("H200", 144384, "NVIDIA-H200"),
        ("RTX PRO 4500", 32768, "NVIDIA-RTX-PRO-4500"),  # not in the list: a label anyway
    ],
)
def test_ec2_gpu_names_map_to_product_labels_by_name_and_memory(name, memory_mib, label):
    assert product_from_ec2(name, memory_mib) == label


@pytest.mark.parametrize(
    ("spec", "memory_mib", "label"),
    [
        ("NVIDIA T4", 16384, "Tesla-T4"),
        ("NVIDIA A10", 24576, "NVIDIA-A10"),
        ("NVIDIA A100", 81920, "NVIDIA-A100-SXM4-80GB"),
        ("NVIDIA A100 80G", 81920, "NVIDIA-A100-SXM4-80GB"),
        ("NVIDIA V100", 32768, "Tesla-V100-SXM2-32GB"),
        ("NVIDIA L20", 49152, "NVIDIA-L20"),  # not a label gpuflow knows: kept as named
    ],
)
def test_a_clouds_gpu_spec_with_its_maker_maps_to_a_product_label(spec, memory_mib, label):
    from gpuflow.tasks.gpus import product_named

    assert product_named(spec, memory_mib) == label


def test_a_currency_rate_comes_from_the_price_table_else_the_setting(monkeypatch):
    from gpuflow.tasks.metrics.cost import PriceTable

    monkeypatch.delenv("GPUFLOW_USD_PER_CNY", raising=False)
    assert PriceTable().usd_rate("USD") == 1.0
    assert PriceTable().usd_rate("CNY") is None
    monkeypatch.setenv("GPUFLOW_USD_PER_CNY", "0.139")
    assert PriceTable().usd_rate("CNY") == 0.139
    assert PriceTable(usd_per_unit={"CNY": 0.14}).usd_rate("CNY") == 0.14  # the table first
    monkeypatch.setenv("GPUFLOW_USD_PER_CNY", "-1")
    assert PriceTable().usd_rate("CNY") is None  # not a rate


def test_credentials_in_a_metrics_url_become_a_basic_auth_header():
    import base64

    from gpuflow.tasks.metrics.prometheus import without_credentials

    bare, headers = without_credentials("http://ops:s3cr%40t@prom.example:9090/api")
    assert bare == "http://prom.example:9090/api"
    scheme, token = headers["Authorization"].split()
    assert scheme == "Basic" and base64.b64decode(token) == b"ops:s3cr@t"
    assert without_credentials("http://prom:9090") == ("http://prom:9090", {})


def test_the_log_figures_table_keeps_every_column_of_every_row():
    from gpuflow.tasks.metrics.logmetrics import TABLE_ROWS, table

    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "acc": 0.5}, {"step": 3, "loss": 1.0}]
    assert table(rows) == [
        {"step": 1, "loss": 2.0, "acc": None},
        {"step": 2, "loss": None, "acc": 0.5},
        {"step": 3, "loss": 1.0, "acc": None},
    ]
    many = [{"step": i} for i in range(TABLE_ROWS * 3)] + [{"step": -1, "eval": 0.9}]
    shown = table(many)
    assert len(shown) == TABLE_ROWS and shown[-1] == {"step": -1, "eval": 0.9}
    assert all(set(row) == {"step", "eval"} for row in shown)


def test_the_extras_table_names_what_pyproject_installs():
    """tasks/extras.py and pyproject.toml name the same extras, and where gpuflow[all] is
    installed (the tests' venv) nothing any of them names is missing."""
    import tomllib
    from pathlib import Path

    from gpuflow.tasks.extras import EXTRAS, missing

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = project["project"]["optional-dependencies"]
    assert set(EXTRAS) == set(declared) - {"all", "test"}
    assert declared["all"] == [f"gpuflow[{','.join(EXTRAS)}]"]
    assert {extra: missing(extra) for extra in EXTRAS} == {extra: [] for extra in EXTRAS}
