"""Each kind's result.json is written and read through one model: what its job writes, the
kind's summary reads; figures not of that shape (a job stopped early) say nothing."""

from __future__ import annotations

import json

import pytest

from gpuflow.tasks.hpc.result import MdResult
from gpuflow.tasks.kinds.registry import get_kind
from gpuflow.tasks.render.result import RenderResult
from gpuflow.tasks.training.result import TrainResult

WRITTEN = {
    "train": TrainResult(
        steps=40, steps_this_attempt=40, samples_per_s=812.5, images_per_s=812.5,
        samples_seen=5120, world_size=2, device="cpu", weights="s3://b/model.pt",
        weights_manifest="s3://b/manifest.json", eval_step=40, eval_loss=0.4321,
        eval_accuracy=0.875,
    ),
    "render": RenderResult(
        frames=10, frames_skipped=2, frames_rendered=8, frames_missing=0, chunks=3,
        blender_invocations=3, render_s=12.5, blender_s=30.1, frames_per_s=0.64,
        mean_frame_s=3.1, blender="4.2.3", engine="CYCLES", output="s3://b/frames",
    ),
    "hpc": MdResult(
        atoms=4000, steps=1000, ranks=4, device="cuda:0", box_length=16.8, seconds=2.0,
        atom_steps_per_s=2.0e6, ns_per_day=12.5, neighbour_rebuilds=20,
        energy_drift_per_atom=1e-5, max_energy_deviation_per_atom=2e-5,
        gpu_vs_cpu_speedup=31.4, gpu_name="NVIDIA H200",
    ),
}  # fmt: skip

SAID = {
    "train": [
        "  trained 40 steps on 2 rank(s) (cpu): 812.5 samples/s, 812.5 images/s",
        "  eval at step 40: loss 0.4321, top-1 accuracy 87.5%",
        "  weights: s3://b/model.pt",
    ],
    "render": [
        "  rendered 8 frames (2 already in storage) in 3 chunk(s), 0.64 frames/s -> s3://b/frames"
    ],
    "hpc": [
        "  md: 4000 atoms x 1000 steps on 4 rank(s) (cuda:0): 2e+06 atom-steps/s, 12.5 ns/day"
        " (argon), energy drift 1.00e-05 per atom",
        "  GPU vs CPU: 31.4x on NVIDIA H200",
    ],
}


@pytest.mark.parametrize("kind", sorted(WRITTEN))
def test_what_the_job_writes_the_kind_reads(kind):
    figures = json.loads(WRITTEN[kind].model_dump_json(exclude_none=True))  # as result.json
    assert get_kind(kind).summary(figures) == SAID[kind]


@pytest.mark.parametrize("kind", sorted(WRITTEN))
def test_figures_of_another_shape_say_nothing(kind):
    partial = dict(list(json.loads(WRITTEN[kind].model_dump_json()).items())[:2])
    assert get_kind(kind).summary(partial) == []
    assert get_kind(kind).summary({}) == []


def test_a_command_jobs_result_is_its_own():
    assert get_kind("command").figures({"loss": 0.1}) is None
