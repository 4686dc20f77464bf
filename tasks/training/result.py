"""The figures a training job writes to outputs/result.json: the job writes them through
this model and the train kind reads them through it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class TrainResult(BaseModel):
    """A finished training run's figures (eval scores appear once an eval ran)."""

    model_config = ConfigDict(extra="allow")  # any further eval_* score the job computes

    steps: int
    steps_this_attempt: int
    samples_per_s: float
    images_per_s: float | None = None  # classify
    tokens_per_s: float | None = None  # language models
    samples_seen: int
    skipped_samples: int = 0
    world_size: int
    device: str
    weights: str
    weights_manifest: str
    checkpoints: str | None = None
    amp: str = "off"
    eval_step: int | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None

    def speed(self) -> tuple[float | None, str]:
        """Return the throughput in the task's own unit, and that unit."""
        if self.images_per_s is not None:
            return self.images_per_s, "images/s"
        return self.tokens_per_s, "tokens/s"
