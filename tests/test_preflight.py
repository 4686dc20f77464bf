"""Preflight against a fake NVML: GPUs present, library missing, driver not loaded, mismatch."""

from __future__ import annotations

from gpuflow.tasks import nvml
from gpuflow.tasks.pipeline import preflight
from gpuflow.tasks.spec import load_spec
from tests.conftest import load_fake_nvml

GPU_JOB = {"job": {"kind": "command", "command": ["true"]}, "resources": {"gpus": 1}}
TORCH_GPU_JOB = {
    "job": {"kind": "command", "command": ["true"], "torch": True},
    "resources": {"gpus": 1},
}


def facts_with(module, torch=None, disk=100 * 2**30, nccl=None):
    return preflight.HostFacts(
        nvml=nvml.query(module),
        nvidia_smi="/usr/bin/nvidia-smi",
        torch=torch or preflight.TorchInfo(),
        disk_free_bytes=disk,
        nccl_env=nccl or {},
    )


def test_inventory_from_nvml():
    status = nvml.query(load_fake_nvml(gpus=2))
    assert status.available
    assert status.driver_version == "550.54.14" and status.cuda_driver_version == "12.4"
    assert [g.index for g in status.gpus] == [0, 1]
    assert status.gpus[0].product == "NVIDIA-H100-80GB-HBM3"
    assert status.gpus[0].memory_total_mib == 81559


def test_inventory_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in nvml.query(load_fake_nvml(gpus=2)).gpus] == [1]


def test_gpus_present_passes():
    report = preflight.verdict(load_spec(GPU_JOB), facts_with(load_fake_nvml()), [0])
    assert report.verdict == "pass"
    assert any("NVIDIA H100" in c.message for c in report.checks)


def test_library_missing_fails_a_gpu_job_with_a_sentence():
    report = preflight.verdict(load_spec(GPU_JOB), facts_with(load_fake_nvml(mode="missing")), [])
    assert report.verdict == "fail"
    (failure,) = report.failures()
    assert "no NVIDIA driver is installed" in failure.message
    assert "resources.allow_cpu: true" in failure.message


def test_driver_not_loaded_is_named():
    report = preflight.verdict(
        load_spec(GPU_JOB), facts_with(load_fake_nvml(mode="not_loaded")), []
    )
    assert report.verdict == "fail"
    assert "driver is installed but not loaded" in report.failures()[0].message


def test_allow_cpu_continues_and_says_so():
    spec = load_spec({**GPU_JOB, "resources": {"gpus": 1, "allow_cpu": True}})
    report = preflight.verdict(spec, facts_with(load_fake_nvml(mode="missing")), [])
    assert report.verdict == "warn"
    assert any("continuing on CPU" in c.message for c in report.checks)


def test_version_mismatch_fails_with_the_fix():
    module = load_fake_nvml(driver="520.61.05", cuda=11080)
    torch = preflight.TorchInfo(version="2.4.1+cu121", cuda_build="12.1", cuda_available=False)
    report = preflight.verdict(load_spec(TORCH_GPU_JOB), facts_with(module, torch=torch), [0])
    assert report.verdict == "fail"
    torch_check = next(c for c in report.checks if c.name == "torch")
    assert "supports only CUDA 11.8" in torch_check.message
    assert "upgrade the NVIDIA driver to 530.30.02" in torch_check.message


def test_busy_gpu_memory_and_low_disk_and_nccl():
    module = load_fake_nvml(free_mib=1000)
    spec = load_spec({**GPU_JOB, "resources": {"gpus": 1, "disk": "10Gi"}})
    report = preflight.verdict(
        spec, facts_with(module, disk=2**30, nccl={"NCCL_DEBUG": "INFO"}), [0]
    )
    levels = {c.name: c.level for c in report.checks}
    assert levels["gpu0-memory"] == "warn"
    assert levels["disk"] == "fail"
    assert any("NCCL_DEBUG=INFO" in c.message for c in report.checks)


def test_inspect_on_this_host_without_gpus(no_nvml, tmp_path):
    facts = preflight.inspect(str(tmp_path), uses_torch=True)
    assert not facts.nvml.available
    assert facts.torch.version is not None  # torch is a dependency
    assert facts.torch.cuda_available is None  # not probed: no GPU to probe for
    assert facts.disk_free_bytes > 0


def test_host_size_checks():
    spec = load_spec(
        {**GPU_JOB, "resources": {"gpus": 1, "cpu": 64, "memory": "2Ti", "shm": "64Gi"}}
    )
    facts = facts_with(load_fake_nvml()).model_copy(
        update={"cpu_count": 8, "memory_total_bytes": 64 * 2**30, "shm_total_bytes": 2**30}
    )
    levels = {c.name: c for c in preflight.verdict(spec, facts, [0]).checks}
    assert levels["cpu"].level == "warn" and "64 CPU cores" in levels["cpu"].message
    assert levels["memory"].level == "fail" and "lower resources.memory" in levels["memory"].message
    assert levels["shm"].level == "warn" and "/dev/shm is 1.0 GiB" in levels["shm"].message
    fitting = load_spec(
        {**GPU_JOB, "resources": {"gpus": 1, "cpu": 4, "memory": "16Gi", "shm": "512Mi"}}
    )
    names = {c.name for c in preflight.verdict(fitting, facts, [0]).checks}
    assert not names & {"cpu", "memory", "shm"}
