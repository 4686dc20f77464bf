"""The one table of failure causes, on the text real programs print (torch, NCCL, gloo,
the kernel, Python, Open MPI, Blender): each row's cause and fix, and the exit codes and
signals that speak when no line does."""

from __future__ import annotations

import pytest

from gpuflow.tasks.diagnose import CAUSES, causes_for, diagnose, match

TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a"
    " total capacity of 79.15 GiB of which 6.69 MiB is free. Including non-PyTorch memory,"
    " this process has 79.14 GiB memory in use. Of the allocated memory 78.40 GiB is"
    " allocated by PyTorch, and 245.34 MiB is reserved by PyTorch but unallocated."
)
CASES = [
    # dash (the unit wrapper's /bin/sh), bash, and the container runtime
    ("sh: 1: trainer: not found", "program_not_found", "the program trainer is not where"),
    ("bash: line 1: blender: command not found", "program_not_found", "the program blender"),
    ("gpuflow-unit: 3: render-farm: not found", "program_not_found", "the program render-farm"),
    (
        "the container could not start: failed to create containerd task: failed to create"
        " shim task: OCI runtime create failed: runc create failed: unable to start container"
        ' process: exec: "render-farm": executable file not found in $PATH: unknown',
        "program_not_found",
        "the program render-farm is not where the job runs",
    ),
    (TORCH_OOM, "cuda_out_of_memory", "it tried to allocate 20.00 MiB more"),
    (
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total"
        " capacity; 13.94 GiB already allocated; 1.14 GiB free; 14.01 GiB reserved in total by"
        " PyTorch)",
        "cuda_out_of_memory",
        "lower job.batch_size",
    ),
    (
        "[rank1]:[E ProcessGroupNCCL.cpp:563] [Rank 1] Watchdog caught collective operation"
        " timeout: WorkNCCL(SeqNum=1024, OpType=ALLREDUCE, NumelIn=2359296,"
        " NumelOut=2359296, Timeout(ms)=600000) ran for 600074 milliseconds before timing out.",
        "collective_timeout",
        "a collective (ALLREDUCE) timed out",
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out"
        " waiting 1800000ms for recv operation to complete",
        "collective_timeout",
        "a gloo collective timed out",
    ),
    (
        "torch.distributed.DistBackendError: NCCL error in:"
        " ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run"
        " with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
        "nccl_system_error",
        "resources.shm",
    ),
    (
        "RuntimeError: The NVIDIA driver on your system is too old (found version 11040)."
        " Please update your GPU driver by downloading and installing a new version from the"
        " URL: http://www.nvidia.com/Download/index.aspx",
        "driver_too_old",
        "install a torch build for the driver's CUDA",
    ),
    (
        "RuntimeError: CUDA error: no kernel image is available for execution on the device",
        "no_kernel_image",
        "no kernels for this GPU's architecture",
    ),
    (
        "RuntimeError: DataLoader worker (pid 28347) is killed by signal: Killed. ",
        "loader_worker_killed",
        "a data loader worker was killed (Killed)",
    ),
    (
        "ERROR: Unexpected bus error encountered in worker. This might be caused by"
        " insufficient shared memory (shm).",
        "loader_shm",
        "raise resources.shm",
    ),
    ("OSError: [Errno 28] No space left on device", "no_space", "raise resources.disk"),
    (
        "ModuleNotFoundError: No module named 'transformers'",
        "missing_module",
        "Python module transformers is not installed",
    ),
    ("bash: line 1:  4242 Segmentation fault      (core dumped) ./md", "segfault", "segmentation"),
    (
        "There are not enough slots available in the system to satisfy the 4",
        "mpi_slots",
        "lower job.ranks",
    ),
    (
        "mpirun was unable to launch the specified application as it could not access",
        "mpi_launch",
        "job.program exists and is executable",
    ),
    (
        "ORTE was unable to reliably start one or more daemons.",
        "mpi_daemons",
        "the nodes reach each other",
    ),
]


@pytest.mark.parametrize(
    ("line", "kind", "said"), CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)]
)
def test_each_known_failure_is_a_cause_and_a_fix(line, kind, said):
    tail = ["step 10 loss 2.31", line, "[torchrun] worker exited with code 1"]
    found = diagnose(1, None, tail)
    assert found is not None and found.kind == kind
    assert said in found.message
    assert ";" in found.message and len(found.message) < 320  # a cause; then the fix


def test_every_any_program_row_is_exercised_by_a_real_line():
    kinds = {c.kind for c in causes_for("any")}
    assert kinds == {kind for _, kind, _ in CASES}


def test_the_peak_memory_and_batch_size_make_the_oom_advice_precise():
    found = diagnose(1, None, [TORCH_OOM], {"peak_gpu_memory_mib": 79 * 1024, "batch_size": 256})
    assert "peak 79.0 GiB seen, batch size 256" in found.message


def test_rows_are_tried_in_order_and_the_last_matching_line_speaks():
    found = match(["ModuleNotFoundError: No module named 'a'", "OSError: [Errno 28] x"])
    assert found.kind == "no_space"  # the table's order first, then lines from the end
    assert match(
        ["ModuleNotFoundError: No module named 'a'", "ModuleNotFoundError: No module named 'b'"]
    ).message.startswith("Python module b")


@pytest.mark.parametrize(
    ("exit_code", "signal", "events", "kind"),
    [
        (None, 9, {"oom_kill": 1}, "oom_killed"),
        (137, None, {"oom_kill": 2}, "oom_killed"),
        (137, None, {}, "killed"),
        (None, 11, {}, "segfault"),
        (139, None, {}, "segfault"),
        (None, 7, {}, "bus_error"),
        (127, None, {}, "program_not_found"),
    ],
)
def test_signals_and_shell_exit_codes_speak_when_no_line_does(exit_code, signal, events, kind):
    found = diagnose(exit_code, signal, ["nothing useful"], {"memory_events": events})
    assert found is not None and found.kind == kind


def test_success_and_unknown_failures_are_not_guessed():
    assert diagnose(0, None, [TORCH_OOM]) is None  # it did not fail
    assert diagnose(3, None, ["Traceback", "ValueError: bad thing"]) is None
    assert diagnose(2, None, []) is None


def test_blender_rows_read_blenders_errors_only():
    assert match(["Error: out of memory"], "blender").kind == "out_of_memory"
    assert match(["no camera here"]) is None  # Blender's rows do not read other logs
    assert {c.program for c in CAUSES} == {"any", "blender"}


def test_a_pod_the_kubelet_oom_killed_is_diagnosed_from_its_status():
    from gpuflow.tasks.backends.kubernetes.backend import _terminated

    status = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "job", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
        ],
    }
    ended = _terminated(status)
    assert ended.signal == 9 and ended.memory_events == {"oom_kill": 1}
    found = diagnose(None, ended.signal, [], {"memory_events": ended.memory_events})
    assert found is not None and found.kind == "oom_killed"
