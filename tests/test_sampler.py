"""The sampler: DCGM names from NVML when there are GPUs, host only otherwise."""

from __future__ import annotations

import time
from pathlib import Path

from gpuflow.tasks.metrics.sampler import Sampler, read_samples
from tests.conftest import load_fake_nvml


def test_samples_gpus_with_dcgm_names(tmp_path):
    path = tmp_path / "s.jsonl"
    with Sampler(path, [0, 1], interval_s=0.05, nvml_module=load_fake_nvml()):
        time.sleep(0.3)
    samples = read_samples(path)
    assert len(samples) >= 3
    gpus = samples[-1]["gpus"]
    assert [g["gpu"] for g in gpus] == [0, 1]
    assert gpus[1]["DCGM_FI_DEV_GPU_UTIL"] == 88
    assert gpus[0]["DCGM_FI_DEV_POWER_USAGE"] == 350.0
    assert gpus[0]["DCGM_FI_DEV_FB_USED"] > 0
    assert gpus[0]["modelName"] == "NVIDIA H100 80GB HBM3"
    assert samples[0]["host"]["memory_used_bytes"] > 0


def test_without_gpus_samples_host_only(tmp_path):
    path = tmp_path / "s.jsonl"
    sampler = Sampler(path, [], interval_s=0.05)
    with sampler:
        time.sleep(0.2)
    samples = read_samples(path)
    assert samples and all(s["gpus"] == [] for s in samples)
    assert sampler.count == len(samples)


def test_nvml_failure_falls_back_to_host(tmp_path):
    path = tmp_path / "s.jsonl"
    sampler = Sampler(path, [0], interval_s=0.05, nvml_module=load_fake_nvml(mode="not_loaded"))
    with sampler:
        time.sleep(0.1)
    assert "NVML unavailable" in sampler.gpu_error
    assert read_samples(path)[-1]["gpus"] == []


def test_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"t": 1, "gpus": [], "host": {}}\n{"t": 2, "gp')
    assert len(read_samples(path)) == 1


def test_a_full_disk_loses_samples_not_the_sampler():
    """/dev/full answers every write with ENOSPC, as a full workspace does: the sampler
    keeps going, counts what it lost and says why once."""
    sampler = Sampler(Path("/dev/full"), [], interval_s=0.05)
    with sampler:
        deadline = time.monotonic() + 30
        while sampler.lost < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sampler.lost >= 3 and sampler.count == 0
    assert sampler.write_error == "/dev/full: No space left on device"


def test_a_sample_tail_hands_on_whole_lines_as_files_grow(tmp_path):
    """The nodes' sample files in a shared folder: each whole line once, a line still being
    written when it is whole, a removed file forgotten, other files never read."""
    from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES, SampleTail

    got: list[dict] = []
    tail = SampleTail(tmp_path, NODE_SAMPLES, got.append)
    g1, g2 = (tmp_path / NODE_SAMPLES.replace("*", name) for name in ("g1", "g2"))
    g1.write_text('{"t": 1, "node": "g1"}\n{"t": 2, "no')
    g2.write_text('{"t": 1, "node": "g2"}\n')
    (tmp_path / SAMPLES).write_text('{"t": 0, "node": "joined"}\n')
    tail.read_new()
    assert got == [{"t": 1, "node": "g1"}, {"t": 1, "node": "g2"}]
    with g1.open("a") as out:
        out.write('de": "g1"}\nnot json\n')
    g2.unlink()
    tail.read_new()
    assert got[2:] == [{"t": 2, "node": "g1"}]
    tail.read_new()
    assert len(got) == 3
