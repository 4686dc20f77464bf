"""Checks a train job before anything is provisioned: data, output, model, strategy."""

from __future__ import annotations

import importlib
import uuid

from tasks import nvml
from tasks.errors import InvalidSpec
from tasks.spec import JobSpec
from tasks.storage import S3Settings, StorageError, join, store_for
from tasks.training import data
from tasks.training.model import TrainJob


def ranks_for(spec: JobSpec, job: TrainJob, host_gpus: int) -> int:
    """Return how many ranks the job will start on a host with `host_gpus` GPUs."""
    return (
        min(spec.resources.gpus, host_gpus)
        if spec.resources.gpus and host_gpus
        else job.cpu_processes
    )


def check_model(job: TrainJob) -> None:
    """Raise InvalidSpec unless `job.model` imports and its factory returns an nn.Module."""
    module_name, colon, factory_name = job.model.partition(":")
    if not colon or not module_name or not factory_name:
        raise InvalidSpec(
            f"job.model: {job.model!r} is not an import path; write module:factory, e.g. tasks.training.models:small_cnn."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise InvalidSpec(
            f"job.model: module {module_name!r} does not import ({type(exc).__name__}: {exc}); install it or fix the path."
        ) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise InvalidSpec(
            f"job.model: {module_name} has no function {factory_name!r}; fix the name after the colon."
        )
    from torch import nn

    try:
        model = factory(**job.model_args)
    except Exception as exc:
        raise InvalidSpec(
            f"job.model: {job.model}(**model_args) failed ({type(exc).__name__}: {exc}); fix job.model_args."
        ) from None
    if not isinstance(model, nn.Module):
        raise InvalidSpec(
            f"job.model: {job.model} returned {type(model).__name__}, not a torch.nn.Module; return the model from the factory."
        )
    declared = getattr(model, "gpuflow_task", None)
    if declared and declared != job.task:
        raise InvalidSpec(
            f"job.task: {job.model} is a {declared} model but job.task is {job.task}; set job.task: {declared}."
        )
    if job.activation_checkpointing and not hasattr(model, "set_activation_checkpointing"):
        raise InvalidSpec(
            "job.activation_checkpointing: the model has no set_activation_checkpointing(); turn the option off."
        )


def check_train(spec: JobSpec, s3: S3Settings | None, here: bool) -> None:
    """Raise InvalidSpec when the train job cannot run as written; makes nothing but a
    probe. With `here`, ranks run on this host and its GPUs count; elsewhere each node has
    the GPUs asked for."""
    job = spec.job
    assert isinstance(job, TrainJob)
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
    except StorageError as exc:
        raise InvalidSpec(f"storage: {exc}") from None
    check_model(job)
