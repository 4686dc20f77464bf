"""The training entry point, one process per rank (started by torchrun through launch.py).

Streams webdataset shards from storage, trains with DDP (or FSDP on GPUs), AMP on CUDA,
checkpoints every N steps or M minutes, resumes from the newest valid checkpoint, and on
SIGTERM finishes its step, checkpoints and exits with the "preempted" code.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gpuflow.tasks.errors import ERROR_FILE, PREEMPTED_EXIT_CODE, GpuflowError, InvalidSpec
from gpuflow.tasks.storage import join, store_for
from gpuflow.tasks.training import checkpoint as ckpt
from gpuflow.tasks.training import data as wdata
from gpuflow.tasks.training.model import PREEMPTED_MARKER, TrainJob
from gpuflow.tasks.training.profile import StepProfiler
from gpuflow.tasks.training.result import TrainResult
from gpuflow.tasks.training.shards import sha256

_stop_requested = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _stop_requested
    _stop_requested = True


def build_model(job: TrainJob) -> nn.Module:
    """Return the nn.Module the job's `module:factory` makes; what is wrong with it is one
    sentence naming job.model (this is the first place the user's code runs)."""
    import importlib

    module_name, _, factory_name = job.model.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise InvalidSpec(
            f"job.model: module {module_name!r} does not import ({type(exc).__name__}: {exc}); install it or fix the path."
        ) from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise InvalidSpec(
            f"job.model: {module_name} has no function {factory_name!r}; fix the name after the colon."
        )
    try:
        model = factory(**job.model_args)
    except Exception as exc:
        raise InvalidSpec(
            f"job.model: {job.model}(**model_args) failed ({type(exc).__name__}: {exc}); fix job.model_args."
        ) from exc
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
    return model


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _schedule(job: TrainJob):
    def factor(step: int) -> float:
        if step < job.warmup_steps:
            return (step + 1) / job.warmup_steps
        if job.schedule == "constant":
            return 1.0
        progress = (step - job.warmup_steps) / max(1, job.max_steps - job.warmup_steps)
        if job.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Trainer:
    def __init__(self, job: TrainJob, run_name: str, dataset_index: str = "") -> None:
        self.job = job
        self.run_name = run_name
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # what a checkpoint of this job records, and a resume compares
        self.identity = ckpt.identity(job, self.world, dataset_index, run_name)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{self.local_rank}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.store = store_for(job.dataset)
        self.out_store = store_for(job.output)
        self.ckpt_prefix = join(job.output, "checkpoints")
        self.outputs = Path(os.environ.get("GPUFLOW_OUTPUT_DIR", "outputs"))
        self.outputs.mkdir(parents=True, exist_ok=True)
        self.workspace = Path(os.environ.get("GPUFLOW_WORKSPACE", "."))
        self.skipped = 0
        self.last_eval: dict[str, float] = {}
        self.keys_file = (
            (self.outputs / f"keys-rank{self.rank}.txt").open("a") if job.log_sample_keys else None
        )

        torch.manual_seed(job.seed)
        random.seed(job.seed + self.rank)
        np.random.seed(job.seed + self.rank)
        if not self.cuda:
            torch.use_deterministic_algorithms(True)
        model: Any = build_model(job).to(self.device)
        if job.activation_checkpointing:
            model.set_activation_checkpointing(True)
        self.amp_dtype = None
        if self.cuda and job.amp == "auto":
            self.amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if job.strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

            mixed = MixedPrecision(param_dtype=self.amp_dtype) if self.amp_dtype else None
            self.model: Any = FullyShardedDataParallel(
                model, device_id=self.device, mixed_precision=mixed
            )
        else:
            self.model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.local_rank] if self.cuda else None
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=job.lr, weight_decay=job.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(job))
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0
        self.samples_seen = 0

    # -- data -------------------------------------------------------------------
    def _codec(self):
        if self.job.task == "lm":
            seq_len = int(self.job.model_args.get("seq_len", 128))
            return (lambda s: wdata.decode_lm(s, seq_len)), wdata.collate_lm
        return wdata.decode_classify, wdata.collate_classify

    def _loader(self, urls: list[str], epoch: int, shuffle: bool):
        """Return the batches of `urls` for `epoch`: an iterator whose loader workers have
        started (with SIGTERM held, see _ignore_sigterm)."""
        decode, collate = self._codec()
        dataset = wdata.batches(
            urls,
            lambda: store_for(urls[0]),
            decode,
            collate,
            batch_size=self.job.batch_size,
            epoch=epoch,
            seed=self.job.seed,
            shuffle_buffer=self.job.shuffle_buffer if shuffle else 0,
            policy=self.job.on_corrupt,
            rank=self.rank,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.job.num_workers,
            persistent_workers=False,
            worker_init_fn=_ignore_sigterm,
        )
        return started(loader)

    def _stream(self, urls: list[str]):
        """Yield batches forever, epoch after epoch; resumes at (epoch, batches_in_epoch)."""
        while True:
            skip = self.batches_in_epoch
            produced = 0
            for batch in self._loader(urls, self.epoch, shuffle=True):
                produced += 1
                if produced <= skip:
                    continue  # already trained on before the checkpoint
                self.batches_in_epoch = produced
                yield batch
            if produced == 0:
                raise wdata.DataError(f"rank {self.rank} got no samples from {self.job.dataset}")
            self.epoch += 1
            self.batches_in_epoch = 0

    # -- the step ----------------------------------------------------------------
    def _loss(self, inputs: Any) -> tuple[torch.Tensor, int]:
        loss, tokens, _ = self._forward(inputs)
        return loss, tokens

    def _forward(self, inputs: Any) -> tuple[torch.Tensor, int, int | None]:
        """Return the batch's loss, its token count (LM) and, for classification, how many
        of its samples the model's top-1 class gets right."""
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
        ):
            if self.job.task == "lm":
                tokens = inputs.to(self.device)
                logits = self.model(tokens[:, :-1])
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
                )
                return loss, tokens[:, 1:].numel(), None
            images, labels = inputs
            logits = self.model(images.to(self.device))
            labels = labels.to(self.device)
            correct = int((logits.argmax(dim=-1) == labels).sum().item())
            return F.cross_entropy(logits.float(), labels), 0, correct

    def _agree(self, flag: bool) -> bool:
        """Return True on every rank if any rank says so (SIGTERM reaches ranks at different times)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def train(self, urls: list[str], eval_urls: list[str] | None) -> int:
        job = self.job
        self._resume()
        self.started = time.perf_counter()
        self.first_step = self.step
        self.first_samples = self.samples_seen
        stream = self._stream(urls)
        metrics_log = (self.outputs / "train_metrics.jsonl").open("a") if self.rank == 0 else None
        last_ckpt = time.monotonic()
        window_start = time.perf_counter()
        self.model.train()
        with self._profiling() as profiler:
            return self._loop(
                job, stream, eval_urls, metrics_log, profiler, last_ckpt, window_start
            )

    def _profiling(self) -> Any:
        """Return torch.profiler over job.profile's steps on rank 0, else a null context."""
        settings = self.job.profile
        if settings is None or self.rank != 0:
            return contextlib.nullcontext()

        return StepProfiler(
            settings.wait, settings.warmup, settings.active, self.outputs, torch.cuda.is_available()
        )

    def _loop(
        self,
        job: TrainJob,
        stream: Any,
        eval_urls: list[str] | None,
        metrics_log: Any,
        profiler: Any,
        last_ckpt: float,
        window_start: float,
    ) -> int:
        window_samples, window_tokens = 0, 0
        while self.step < job.max_steps:
            step_start = time.perf_counter()
            data_wait = 0.0
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            step_samples = 0
            for micro in range(job.grad_accum):
                waited = time.perf_counter()
                batch = next(stream)
                data_wait += time.perf_counter() - waited
                self.skipped += batch["skipped"]
                if self.keys_file:
                    self.keys_file.write("".join(f"{self.epoch}\t{key}\n" for key in batch["keys"]))
                    self.keys_file.flush()
                sync = micro == job.grad_accum - 1 or job.strategy == "fsdp"
                context = self.model.no_sync() if not sync else contextlib.nullcontext()
                with context:
                    loss, tokens = self._loss(batch["inputs"])
                    self.scaler.scale(loss / job.grad_accum).backward()
                total += loss.item() / job.grad_accum
                step_samples += len(batch["keys"])
                window_tokens += tokens
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.step += 1
            if profiler is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the step's kernels belong to its compute time
                profiler.step(self.step, data_wait, time.perf_counter() - step_start)
            window_samples += step_samples
            self.samples_seen += step_samples
            if self.step % job.log_every == 0 or self.step == job.max_steps:
                elapsed = time.perf_counter() - window_start
                record = {
                    "step": self.step,
                    "loss": total,
                    "lr": self.scheduler.get_last_lr()[0],
                    "samples_per_s": window_samples * self.world / elapsed,
                    "tokens_per_s": window_tokens * self.world / elapsed if window_tokens else None,
                    "epoch": self.epoch,
                    "time": time.time(),
                }
                if metrics_log:
                    metrics_log.write(json.dumps(record) + "\n")
                    metrics_log.flush()
                    print(
                        f"step {self.step}/{job.max_steps} loss {total:.4f} {record['samples_per_s']:.1f} samples/s",
                        flush=True,
                    )
                window_start, window_samples, window_tokens = time.perf_counter(), 0, 0
            # Eval on its own schedule, and once at the end whenever there is an eval set.
            if eval_urls and (
                (job.eval_every and self.step % job.eval_every == 0) or self.step == job.max_steps
            ):
                scores = self.evaluate(eval_urls)
                self.last_eval = {"step": self.step, **scores}
                if metrics_log:
                    metrics_log.write(json.dumps(self.last_eval) + "\n")
                    metrics_log.flush()
                    print(f"eval at step {self.step}: {describe_eval(scores)}", flush=True)
            due = self.step % job.checkpoint.every_steps == 0
            if job.checkpoint.every_minutes:
                due = due or time.monotonic() - last_ckpt > job.checkpoint.every_minutes * 60
            stop = self._agree(_stop_requested)
            if self._agree(due) or stop:
                self.save()
                last_ckpt = time.monotonic()
            if stop and self.step < job.max_steps:
                if self.rank == 0:
                    print(
                        f"preempted at step {self.step}: checkpoint saved, exiting {PREEMPTED_EXIT_CODE}",
                        flush=True,
                    )
                (self.workspace / PREEMPTED_MARKER.format(rank=self.rank)).write_text(
                    str(self.step)
                )
                return PREEMPTED_EXIT_CODE
        if self.step % job.checkpoint.every_steps:
            self.save()
        self.finish()
        return 0

    def evaluate(self, urls: list[str]) -> dict[str, float]:
        """Return the mean eval loss over all ranks' batches and, for classification, the
        top-1 accuracy over all their samples."""
        self.model.eval()
        loss_sum, batches, correct, samples = 0.0, 0, 0, 0
        with torch.no_grad():
            for index, batch in enumerate(self._loader(urls, 0, shuffle=False)):
                if index >= self.job.eval_batches:
                    break
                loss, _, right = self._forward(batch["inputs"])
                loss_sum, batches = loss_sum + loss.item(), batches + 1
                if right is not None:
                    correct, samples = correct + right, samples + len(batch["keys"])
        self.model.train()
        totals = torch.tensor(
            [loss_sum, batches, correct, samples], device=self.device, dtype=torch.float64
        )
        dist.all_reduce(totals)
        loss_sum, batches, correct, samples = totals.tolist()
        scores = {"eval_loss": loss_sum / max(batches, 1)}
        if self.job.task == "classify" and samples:
            scores["eval_accuracy"] = correct / samples
        return scores

    # -- checkpoints ---------------------------------------------------------------
    def _full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.job.strategy == "fsdp":
            from torch.distributed.fsdp import (
                FullStateDictConfig,
                FullyShardedDataParallel,
                StateDictType,
            )

            config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FullyShardedDataParallel.state_dict_type(
                self.model, StateDictType.FULL_STATE_DICT, config
            ):
                model_state = self.model.state_dict()
                optim_state = FullyShardedDataParallel.optim_state_dict(self.model, self.optimizer)
            return model_state, optim_state
        return self.model.module.state_dict(), self.optimizer.state_dict()

    def save(self) -> None:
        model_state, optim_state = self._full_state()
        rank_state = {
            "rng": _rng_state(),
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "samples_seen": self.samples_seen,
        }
        mine = ckpt.write_file(
            self.out_store,
            self.ckpt_prefix,
            self.step,
            f"rank-{self.rank}.pt",
            ckpt.to_bytes(rank_state),
        )
        shas: list[Any] = [None] * self.world
        dist.all_gather_object(shas, mine)
        if self.rank == 0:
            files = {f"rank-{r}.pt": sha for r, sha in enumerate(shas)}
            trainer_state = {
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
            }
            files["model.pt"] = ckpt.write_file(
                self.out_store, self.ckpt_prefix, self.step, "model.pt", ckpt.to_bytes(model_state)
            )
            files["trainer.pt"] = ckpt.write_file(
                self.out_store,
                self.ckpt_prefix,
                self.step,
                "trainer.pt",
                ckpt.to_bytes(trainer_state),
            )
            ckpt.write_manifest(
                self.out_store,
                self.ckpt_prefix,
                self.step,
                files,
                {"world_size": self.world, "model": self.job.model, "identity": self.identity},
            )
            ckpt.prune(self.out_store, self.ckpt_prefix, self.job.checkpoint.keep)
            print(
                f"checkpoint step {self.step} saved to {ckpt.step_prefix(self.ckpt_prefix, self.step)}",
                flush=True,
            )
        dist.barrier()

    def _resume(self) -> None:
        found = ckpt.latest_valid(self.out_store, self.ckpt_prefix) if self.rank == 0 else None
        holder = [found[0] if found else None]
        dist.broadcast_object_list(holder, src=0)
        step = holder[0]
        if step is None:
            return
        files = ckpt.load_valid(self.out_store, self.ckpt_prefix, step)
        if files is None:  # rank 0 read it whole; this rank could not, now
            raise RuntimeError(
                f"checkpoint step {step} could not be read whole by rank {self.rank} (it is"
                " incomplete or damaged now); check the storage, or start a new output prefix"
            )
        manifest = json.loads(files[ckpt.MANIFEST])
        if self.job.checkpoint.resume == "same_job":
            refused = ckpt.mismatch(manifest, self.identity, self.ckpt_prefix, step)
            if refused:
                raise InvalidSpec(refused)
        if manifest.get("world_size") != self.world:
            raise RuntimeError(
                f"checkpoint step {step} was written by {manifest.get('world_size')} ranks, this run has"
                f" {self.world}; resume with the same number of GPUs or start a new output prefix"
            )
        model_state = ckpt.from_bytes(files["model.pt"])
        trainer_state = ckpt.from_bytes(files["trainer.pt"])
        rank_state = ckpt.from_bytes(files[f"rank-{self.rank}.pt"])
        if self.job.strategy == "fsdp":
            from torch.distributed.fsdp import (
                FullStateDictConfig,
                FullyShardedDataParallel,
                StateDictType,
            )

            config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
            with FullyShardedDataParallel.state_dict_type(
                self.model, StateDictType.FULL_STATE_DICT, config
            ):
                self.model.load_state_dict(model_state)
                optim = FullyShardedDataParallel.optim_state_dict_to_load(
                    self.model, self.optimizer, trainer_state["optimizer"]
                )
            self.optimizer.load_state_dict(optim)
        else:
            self.model.module.load_state_dict(model_state)
            self.optimizer.load_state_dict(trainer_state["optimizer"])
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self.scaler.load_state_dict(trainer_state["scaler"])
        self.step = trainer_state["step"]
        self.samples_seen = rank_state["samples_seen"]
        self.epoch = rank_state["epoch"]
        self.batches_in_epoch = rank_state["batches_in_epoch"]
        _set_rng_state(rank_state["rng"])
        if self.rank == 0:
            print(f"resumed from checkpoint step {step}", flush=True)

    def finish(self) -> None:
        """Copy the final weights to models/ with a manifest; write result.json."""
        model_state, _ = self._full_state()
        counts = torch.tensor(
            [self.skipped, self.samples_seen, self.samples_seen - self.first_samples],
            device=self.device,
            dtype=torch.float64,
        )
        dist.all_reduce(counts)
        skipped, samples_seen, samples_here = (int(v) for v in counts.tolist())
        if self.rank != 0:
            return
        data = ckpt.to_bytes(model_state)
        base = join(self.job.output, "models", self.run_name, f"step-{self.step:08d}")
        weights = self.out_store.write_bytes(join(base, "model.pt"), data)
        manifest = {
            "step": self.step,
            "model": self.job.model,
            "model_args": self.job.model_args,
            "task": self.job.task,
            "dataset": self.job.dataset,
            "files": {"model.pt": weights.sha256 or sha256(data)},
            "samples_seen": samples_seen,
        }
        manifest_url = join(base, "manifest.json")
        self.out_store.write_bytes(manifest_url, json.dumps(manifest, indent=2).encode())
        seconds = time.perf_counter() - self.started
        steps_here = self.step - self.first_step
        samples_per_s = samples_here / max(seconds, 1e-9)
        per_sample = (
            1 if self.job.task == "classify" else int(self.job.model_args.get("seq_len", 128))
        )
        speed = round(samples_per_s * per_sample, 2)
        result = TrainResult(
            steps=self.step,
            steps_this_attempt=steps_here,
            samples_per_s=round(samples_per_s, 2),
            images_per_s=speed if self.job.task == "classify" else None,
            tokens_per_s=None if self.job.task == "classify" else speed,
            samples_seen=samples_seen,
            skipped_samples=skipped,
            world_size=self.world,
            device=torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            weights=weights.url,
            weights_manifest=manifest_url,
            checkpoints=self.ckpt_prefix,
            amp=str(self.amp_dtype).removeprefix("torch.") if self.amp_dtype else "off",
            **{("eval_step" if k == "step" else k): v for k, v in self.last_eval.items()},
        )
        (self.outputs / "result.json").write_text(
            result.model_dump_json(indent=2, exclude_none=True)
        )
        print(f"final weights: {weights.url}", flush=True)


def describe_eval(scores: dict[str, float]) -> str:
    """Return eval scores for a log line: loss 0.4321, top-1 accuracy 87.5%."""
    text = f"loss {scores['eval_loss']:.4f}"
    if "eval_accuracy" in scores:
        text += f", top-1 accuracy {100 * scores['eval_accuracy']:.1f}%"
    return text


def started(loader: torch.utils.data.DataLoader) -> Any:
    """Return `loader`'s iterator, its workers started with SIGTERM held in their signal
    mask until they ignore it (its worker_init_fn: _ignore_sigterm)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(loader)  # the workers start here
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # one sent to the rank lands now


def _ignore_sigterm(worker_id: int) -> None:
    # SIGTERM reaches the whole process group; the rank decides when to stop, and it
    # shuts its loader workers down itself. A worker starts with SIGTERM held (the rank
    # blocks it while it starts them): torch's own handler, set before this runs, would
    # end the worker on a SIGTERM that is not its rank's. Ignored first, then let in: one
    # that came meanwhile is dropped.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def main() -> int:
    job = TrainJob.model_validate_json(os.environ["GPUFLOW_TRAIN_JOB"])
    run_name = os.environ.get("GPUFLOW_RUN_NAME", "run")
    signal.signal(signal.SIGTERM, _on_sigterm)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    try:
        return _train(job, run_name)
    except Exception as exc:
        # One sentence for the pipeline to show instead of torchrun's summary.
        # A loader worker's exception arrives with the worker's traceback in its text.
        last = next((line for line in reversed(str(exc).splitlines()) if line.strip()), "")
        last = last.removeprefix(f"{type(exc).__name__}: ")
        reason = last if isinstance(exc, GpuflowError) else f"{type(exc).__name__}: {last}"
        error = Path(os.environ.get("GPUFLOW_OUTPUT_DIR", "outputs")) / ERROR_FILE
        error.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError), error.open("x") as handle:
            handle.write(f"rank {dist.get_rank() if dist.is_initialized() else '?'}: {reason}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(job: TrainJob, run_name: str) -> int:
    index = wdata.load_index(job.dataset, store_for(job.dataset))
    eval_urls = None
    if job.eval_dataset:
        eval_index = wdata.load_index(
            job.eval_dataset, store_for(job.eval_dataset), "train.eval_dataset"
        )
        eval_urls = eval_index.urls(job.eval_dataset)
    digest = ckpt.index_digest(index.model_dump_json())
    return Trainer(job, run_name, digest).train(index.urls(job.dataset), eval_urls)


if __name__ == "__main__":
    sys.exit(main())
