"""A stop's SIGTERM reaches the rank's whole process group, its loader workers too: a
worker that gets it while it starts (after torch set its own SIGTERM handler, before
worker_init_fn ignores the signal) must live on, or the rank fails instead of saving its
checkpoint."""

from __future__ import annotations

import os
import signal
import time

import torch

from gpuflow.tasks.training import entry


class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_a_sigterm_while_a_loader_worker_starts_does_not_end_it(tmp_path, monkeypatch):
    inside = tmp_path / "starting"
    seed = torch.manual_seed

    def slow_seed(value):  # called by the worker between torch's handler and init_fn
        if os.getpid() != parent:
            inside.write_text(str(os.getpid()))
            time.sleep(1.0)
        return seed(value)

    parent = os.getpid()
    monkeypatch.setattr(torch, "manual_seed", slow_seed)
    loader = torch.utils.data.DataLoader(
        Numbers(), batch_size=None, num_workers=1, worker_init_fn=entry._ignore_sigterm
    )
    batches = entry.started(loader)
    deadline = time.monotonic() + 60
    while not inside.exists() or not inside.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.01)
    os.kill(int(inside.read_text()), signal.SIGTERM)  # as the stop's killpg would
    assert [int(b) for b in batches] == [0, 1, 2]
