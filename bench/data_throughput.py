"""Data throughput: samples/s through gpuflow's webdataset pipeline from an S3 server on
loopback vs the same shards on local disk vs a plain torch Dataset over loose files.

Every source is decoded the same way (PNG -> tensor) into batches of 64; each is read
`--rounds` times, alternating, and the best round counts. Targets: S3 >= 0.8x local
shards; shards >= 2x loose files. Loose files are measured both on local disk and in S3.

    python bench/data_throughput.py [--samples 3000] [--rounds 3] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moto_server import start_moto  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    import torch

    from gpuflow.tasks.storage import FileStore, S3Settings, S3Store
    from gpuflow.tasks.training import data as wdata
    from gpuflow.tasks.training.prepare import prepare
    from gpuflow.tasks.training.shards import synthetic_samples

    proc, endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        s3 = S3Store(S3Settings.from_env())
        s3.client.create_bucket(Bucket="bench")
        work = Path(tempfile.mkdtemp(prefix="gpuflow-data-bench-"))
        source = f"synthetic:classify?samples={args.samples}"
        local_url, s3_url = f"file://{work}/shards", "s3://bench/shards"
        prepare(source, local_url, 1_000_000, FileStore())
        prepare(source, s3_url, 1_000_000, s3)
        loose = work / "loose"
        loose.mkdir()
        for sample in synthetic_samples("classify", args.samples):
            for ext in ("png", "cls"):
                (loose / f"{sample['__key__']}.{ext}").write_bytes(sample[ext])
                s3.write_bytes(f"s3://bench/loose/{sample['__key__']}.{ext}", sample[ext])
        keys = sorted(p.stem for p in loose.glob("*.png"))

        class LooseFiles(torch.utils.data.Dataset):
            def __init__(self, read):
                self.read = read

            def __len__(self):
                return len(keys)

            def __getitem__(self, i):
                key = keys[i]
                return wdata.decode_classify(
                    {"png": self.read(f"{key}.png"), "cls": self.read(f"{key}.cls")}
                )

        def shards(url, store_factory):
            index = wdata.load_index(url, store_factory())
            dataset = wdata.batches(
                index.urls(url),
                store_factory,
                wdata.decode_classify,
                wdata.collate_classify,
                batch_size=64,
                epoch=0,
                seed=0,
                shuffle_buffer=0,
                policy="fail",
                rank=0,
            )
            return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers)

        def loose_loader(read):
            return torch.utils.data.DataLoader(
                LooseFiles(read),
                batch_size=64,
                num_workers=args.workers,
                collate_fn=wdata.collate_classify,
            )

        sources = {
            "S3 shards": lambda: shards(s3_url, lambda: S3Store(S3Settings.from_env())),
            "local shards": lambda: shards(local_url, FileStore),
            "loose files (disk)": lambda: loose_loader(lambda name: (loose / name).read_bytes()),
            "loose files (S3)": lambda: loose_loader(
                lambda name: S3Store(S3Settings.from_env()).read_bytes(f"s3://bench/loose/{name}")
            ),
        }
        best = {name: 0.0 for name in sources}
        for _ in range(args.rounds):
            for name, make in sources.items():
                start, count = time.perf_counter(), 0
                for batch in make():
                    count += len(batch["keys"]) if isinstance(batch, dict) else len(batch[1])
                rate = count / (time.perf_counter() - start)
                best[name] = max(best[name], rate)
        print(
            f"{args.samples} samples of 32x32 PNG, batches of 64, {args.workers} loader worker(s), best of {args.rounds}"
        )
        for name, rate in best.items():
            print(f"  {name:22} {rate:10.1f} samples/s")
        print(
            f"S3 shards / local shards:        {best['S3 shards'] / best['local shards']:.2f}x   (target >= 0.8)"
        )
        print(
            f"local shards / loose files disk: {best['local shards'] / best['loose files (disk)']:.2f}x   (target >= 2)"
        )
        print(
            f"S3 shards / loose files S3:      {best['S3 shards'] / best['loose files (S3)']:.2f}x"
        )
        print(json.dumps({k: round(v, 1) for k, v in best.items()}))
        shutil.rmtree(work, ignore_errors=True)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
