"""Training overhead: steps/s of the `train` flow vs a bare torch loop, same model and data.

The flow runs the whole pipeline (torchrun, one CPU rank, DDP wrapper, checkpoints,
metrics); its steps/s is measured over the training loop as the rank reports it, and
the end-to-end wall time is printed too. The bare loop is what one would write by hand:
webdataset over the same local shards, the same model, AdamW, no checkpoints.
Target: flow >= 0.95x bare.

    python bench/train_overhead.py [--steps 200] [--batch 32]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bare_loop(shards: list[str], steps: int, batch_size: int) -> float:
    """Return steps/s of a hand-written loop over the same shards."""
    import numpy as np
    import torch
    import webdataset as wds
    from PIL import Image
    from torch.nn import functional as F

    from gpuflow.tasks.training.models import small_cnn

    def decode(sample):
        image = np.asarray(
            Image.open(io.BytesIO(sample["png"])).convert("RGB"), dtype=np.uint8
        ).copy()
        return torch.from_numpy(image).permute(2, 0, 1).float().div_(255.0), int(sample["cls"])

    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = (
        wds.WebDataset([s.removeprefix("file://") for s in shards], shardshuffle=False)
        .map(decode)
        .batched(batch_size)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=1)
    done, start = 0, None
    while done < steps:
        for images, labels in loader:
            if done == 5:
                start = time.perf_counter()  # same warm-up as the flow's first log window
            loss = F.cross_entropy(model(images), torch.as_tensor(labels))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return (steps - 5) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuflow-train-bench-"))
    os.environ.setdefault("GPUFLOW_HOME", str(work / "home"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.flows.train import train
    from gpuflow.tasks.storage import FileStore
    from gpuflow.tasks.training.prepare import prepare
    from gpuflow.tasks.training.report import read_metrics
    from gpuflow.tasks.training.shards import DatasetIndex

    data_url = f"file://{work}/data"
    prepare("synthetic:classify?samples=2000", data_url, 200_000, FileStore())
    index = DatasetIndex.model_validate_json((work / "data" / "index.json").read_text())
    bare = bare_loop(index.urls(data_url), args.steps, args.batch)
    spec = {
        "name": "bench",
        "job": {
            "kind": "train",
            "dataset": data_url,
            "output": f"file://{work}/out",
            "batch_size": args.batch,
            "max_steps": args.steps,
            "num_workers": 1,
            "shuffle_buffer": 0,
            "log_every": 5,
            "checkpoint": {"every_steps": 100},
        },
    }
    with prefect_test_harness(server_startup_timeout=120):
        start = time.perf_counter()
        result = train(spec)
        wall = time.perf_counter() - start
    rows = read_metrics(Path(result.artifacts_dir) / "outputs" / "train_metrics.jsonl")
    first, last = rows[0], rows[-1]  # from the end of the first window (step 5), as the bare loop
    flow = (last["step"] - first["step"]) / (last["time"] - first["time"])
    print(f"{args.steps} steps of small_cnn, batch {args.batch}, 1 CPU rank, 1 loader worker")
    print(f"{'':28}{'bare loop':>12}{'train flow':>12}")
    print(f"{'steps/s in the loop':28}{bare:12.2f}{flow:12.2f}")
    print(f"ratio flow/bare: {flow / bare:.3f}   (target >= 0.95)")
    print(
        f"train flow end to end: {wall:.1f} s for {args.steps} steps (torchrun start, checkpoints, teardown included)"
    )


if __name__ == "__main__":
    main()
