"""The `job:` section of a training spec (kind `train`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gpuflow.tasks.spec import SpecModel, StorageUrl

# the file each rank leaves in the workspace when it stopped on SIGTERM with its state
# saved; the launcher exits "preempted" when every rank left one
PREEMPTED_MARKER = ".gpuflow-preempted-rank{rank}"


class CheckpointSettings(SpecModel):
    every_steps: int = Field(100, ge=1, description="Checkpoint every N optimiser steps.")
    every_minutes: float | None = Field(10.0, gt=0, description="... and at least this often.")
    keep: int = Field(3, ge=1, le=1000, description="How many checkpoints to keep.")
    resume: Literal["same_job", "any"] = Field(
        "same_job",
        description="same_job: resume only from a checkpoint this job wrote (the same model,"
        " data set and ranks), else refuse; any: from whatever checkpoint is under job.output"
        " (the same number of ranks still).",
    )


class ProfileSettings(SpecModel):
    """torch.profiler's schedule: skip `wait` steps, warm up `warmup`, record `active`."""

    wait: int = Field(1, ge=0, le=10_000)
    warmup: int = Field(1, ge=0, le=10_000)
    active: int = Field(3, ge=1, le=100)


class TrainJob(SpecModel):
    """Train a model on webdataset shards with torchrun: DDP or FSDP, AMP, checkpoints."""

    kind: Literal["train"] = "train"
    dataset: StorageUrl = Field(description="Prefix holding index.json and the shards.")
    eval_dataset: StorageUrl | None = Field(None, description="Held-out shards for evaluation.")
    output: StorageUrl = Field(description="Prefix for checkpoints/ and models/.")
    model: str = Field("gpuflow.tasks.training.models:small_cnn", description="module:factory.")
    model_args: dict[str, Any] = Field(default_factory=dict)
    task: Literal["classify", "lm"] = "classify"
    batch_size: int = Field(32, ge=1, le=65536, description="Samples per rank per micro-step.")
    max_steps: int = Field(1000, ge=1)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    grad_accum: int = Field(1, ge=1, le=1024)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    amp: Literal["auto", "off"] = Field("auto", description="bf16 where supported, else fp16.")
    activation_checkpointing: bool = False
    eval_every: int | None = Field(None, ge=1)
    eval_batches: int = Field(10, ge=1)
    shuffle_buffer: int = Field(1000, ge=0)
    num_workers: int = Field(2, ge=0, le=64)
    cpu_processes: int = Field(1, ge=1, le=64, description="Ranks when there is no GPU.")
    on_corrupt: Literal["skip", "fail"] = "skip"
    seed: int = 0
    log_every: int = Field(10, ge=1)
    log_sample_keys: bool = Field(
        False, description="Write each rank's (epoch, sample key) pairs to outputs/keys-rankN.txt."
    )
    checkpoint: CheckpointSettings = CheckpointSettings()
    profile: ProfileSettings | None = Field(
        None,
        description="Record a torch.profiler trace (Chrome trace JSON) of these steps on rank 0,"
        " with the top operators and each step's data wait vs compute.",
    )
    torch: bool = True

    @model_validator(mode="after")
    def _profile_fits(self) -> TrainJob:
        if self.profile is not None:
            steps = self.profile.wait + self.profile.warmup + self.profile.active
            if steps > self.max_steps:
                raise ValueError(
                    f"profile: wait + warmup + active is {steps} steps but job.max_steps is"
                    f" {self.max_steps}; profile fewer steps or train longer"
                )
        return self
