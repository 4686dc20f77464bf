"""Checks a train job before anything is provisioned: data, output, model, strategy."""

from __future__ import annotations

import importlib.util
import json
import uuid
from typing import Any

from gpuflow.tasks import nvml
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import JobSpec, job_as
from gpuflow.tasks.storage import S3Settings, StorageError, join, store_for
from gpuflow.tasks.training import checkpoint as ckpt
from gpuflow.tasks.training import data
from gpuflow.tasks.training.model import TrainJob


def ranks_for(spec: JobSpec, job: TrainJob, host_gpus: int) -> int:
    """Return how many ranks the job will start on a host with `host_gpus` GPUs."""
    return (
        min(spec.resources.gpus, host_gpus)
        if spec.resources.gpus and host_gpus
        else job.cpu_processes
    )


def check_model(job: TrainJob, here: bool) -> None:
    """Raise InvalidSpec unless `job.model` is written module:factory and, when the job
    runs on this host, its top-level package is installed. Only the name is read: the
    module is imported and the factory called in the job's own process (its workspace,
    cgroup, pod or instance), never in gpuflow's, so a spec can not run code here."""
    module_name, colon, factory_name = job.model.partition(":")
    if not (
        colon
        and all(part.isidentifier() for part in module_name.split("."))
        and factory_name.isidentifier()
    ):
        raise InvalidSpec(
            f"job.model: {job.model!r} is not an import path; write module:factory, e.g. gpuflow.tasks.training.models:small_cnn."
        )
    top = module_name.split(".")[0]
    if here and importlib.util.find_spec(top) is None:  # finds, does not run, the package
        raise InvalidSpec(
            f"job.model: module {top!r} is not installed here; install it or fix the path."
        )


def check_train(spec: JobSpec, s3: S3Settings | None, here: bool) -> None:
    """Raise InvalidSpec when the train job cannot run as written; makes nothing but a
    probe. With `here`, ranks run on this host and its GPUs count; elsewhere each node has
    the GPUs asked for."""
    job = job_as(spec, TrainJob)
    host_gpus = len(nvml.query().gpus) if here else spec.resources.gpus
    ranks = ranks_for(spec, job, host_gpus) * spec.resources.nodes
    if job.strategy == "fsdp" and not (spec.resources.gpus and host_gpus):
        raise InvalidSpec(
            "job.strategy: fsdp shards the model across GPUs and there is none here; use"
            " strategy: ddp on CPU, or ask for GPUs (resources.gpus) on a GPU host."
        )
    try:
        store = store_for(job.dataset, s3)
        index = data.load_index(job.dataset, store, "job.dataset")
        data.check_shards(index, job.dataset, store, "job.dataset")
        if job.eval_dataset:
            eval_store = store_for(job.eval_dataset, s3)
            eval_index = data.load_index(job.eval_dataset, eval_store, "job.eval_dataset")
            data.check_shards(eval_index, job.eval_dataset, eval_store, "job.eval_dataset")
        readers = ranks * max(1, job.num_workers)
        if len(index.shards) < readers:
            raise InvalidSpec(
                f"job.dataset has {len(index.shards)} shard(s) but {ranks} rank(s) x"
                f" {max(1, job.num_workers)} loader worker(s) need at least {readers}; pack"
                " smaller shards or lower job.num_workers."
            )
        out = store_for(job.output, s3)
        probe = join(job.output, f".gpuflow-probe-{uuid.uuid4().hex[:8]}")
        out.write_bytes(probe, b"ok")
        out.delete(probe)
        if job.checkpoint.resume == "same_job":
            digest = ckpt.index_digest(index.model_dump_json())
            # the ranks compare their number themselves: the node's GPUs decide it
            wanted = {**ckpt.identity(job, ranks, digest, spec.name), "world_size": None}
            _check_resume(out, join(job.output, "checkpoints"), wanted)
    except StorageError as exc:
        raise InvalidSpec(f"storage: {exc}") from None
    check_model(job, here and spec.image is None)  # in an image, the image's to have


def _check_resume(out: Any, prefix: str, wanted: dict[str, Any]) -> None:
    """Raise InvalidSpec when the checkpoint this job would resume from is another job's
    (read here before anything is made; the ranks check again as they resume)."""
    for step in ckpt.steps(out, prefix):
        try:
            manifest = json.loads(
                out.read_bytes(join(ckpt.step_prefix(prefix, step), ckpt.MANIFEST))
            )
        except (StorageError, ValueError):
            continue  # half-written: the ranks skip it too
        refused = ckpt.mismatch(manifest, wanted, prefix, step)
        if refused:
            raise InvalidSpec(refused)
        return
