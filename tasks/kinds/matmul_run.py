"""The smoke job: multiply n x n matrices for a while and report achieved TFLOP/s.

Runs on the GPU when torch sees one (in the dtype asked), else on the CPU in
float32. Writes result.json to $GPUFLOW_OUTPUT_DIR and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def benchmark(size: int, dtype_name: str, seconds: float) -> dict:
    """Return achieved TFLOP/s of torch.matmul on the best device here (numpy's on the
    CPU where torch is not installed: gpuflow without its train extra)."""
    try:
        import torch
    except ImportError:
        return _numpy_benchmark(size, seconds)

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, dtype_name) if on_gpu else torch.float32
    note = "" if on_gpu else "no GPU seen by torch: float32 on the CPU"
    if dtype == torch.bfloat16 and on_gpu and not torch.cuda.is_bf16_supported():
        dtype, note = torch.float16, "this GPU has no bfloat16: float16 instead"
    if not on_gpu and size > 2048:
        size = 2048  # keeps one CPU multiply near a second
    torch.manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    torch.matmul(a, b)  # warm-up: kernels selected, clocks up
    sync()
    iterations = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10 if on_gpu else 1):
            torch.matmul(a, b)
            iterations += 1
        sync()
    elapsed = time.perf_counter() - start
    flops = 2.0 * size**3 * iterations
    return {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "on_gpu": on_gpu,
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "iterations": iterations,
        "seconds": round(elapsed, 3),
        "tflops": round(flops / elapsed / 1e12, 4),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "note": note,
    }


def _numpy_benchmark(size: int, seconds: float) -> dict:
    """Return achieved TFLOP/s of numpy's matmul (float32, on the CPU)."""
    import numpy

    size = min(size, 2048)  # keeps one CPU multiply near a second
    rng = numpy.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=numpy.float32)
    b = rng.standard_normal((size, size), dtype=numpy.float32)
    a @ b  # warm-up
    iterations = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iterations += 1
    elapsed = time.perf_counter() - start
    return {
        "device": "cpu",
        "on_gpu": False,
        "dtype": "float32",
        "size": size,
        "iterations": iterations,
        "seconds": round(elapsed, 3),
        "tflops": round(2.0 * size**3 * iterations / elapsed / 1e12, 4),
        "numpy": numpy.__version__,
        "note": "torch is not installed: numpy float32 on the CPU"
        " (pip install 'gpuflow[train]' to measure the GPU)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    result = benchmark(args.size, args.dtype, args.seconds)
    where = "GPU " + result["device"] if result["on_gpu"] else "CPU"
    print(
        f"matmul {result['size']}x{result['size']} {result['dtype']} on {where}: "
        f"{result['tflops']} TFLOP/s over {result['iterations']} multiplies"
        + (f" ({result['note']})" if result["note"] else ""),
        flush=True,
    )
    out_dir = Path(os.environ.get("GPUFLOW_OUTPUT_DIR", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
