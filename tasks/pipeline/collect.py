"""The collect stage: the run's metrics, artifacts and summary from what the job left in
its workspace (samples, outputs, result.json), pushed when a Pushgateway is set."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from gpuflow.tasks import secrets
from gpuflow.tasks.api_client import publish
from gpuflow.tasks.contract import Cluster, RunOutcome
from gpuflow.tasks.errors import CollectError, TransientError
from gpuflow.tasks.host import gpuflow_home, make_dirs, signals_held
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.metrics import cost as pricing
from gpuflow.tasks.metrics.logmetrics import (
    LOG_METRICS,
    curves_png,
    last_values,
    read_rows,
    rows_file,
    table,
)
from gpuflow.tasks.metrics.plot import utilisation_png
from gpuflow.tasks.metrics.prometheus import delete, exposition, push
from gpuflow.tasks.metrics.sampler import SAMPLES, read_samples
from gpuflow.tasks.metrics.summary import IDLE_PCT, RunMetrics, summarise
from gpuflow.tasks.outputs import OutputsKept, copy_outputs, keep_whole
from gpuflow.tasks.pictures import picture
from gpuflow.tasks.pipeline.costs import cost_of
from gpuflow.tasks.pipeline.pool import Use
from gpuflow.tasks.spec import JobSpec


def _product(cluster: Cluster) -> str:
    """Return the GPU product the run held ("none" for CPU only, "A + B" for several)."""
    products = sorted(set(cluster.gpu_products))
    return "none" if not cluster.gpu_indices or not products else " + ".join(products)


RESULT_LIMIT = 1 << 20  # result.json holds figures, not data


def _copy_outputs(outputs: Path, out: Path, redact: Callable[[str], str], logger: Any) -> None:
    """Copy the job's outputs folder into the artifacts `out` as the job left it (never
    following it when the job swapped it for a link); what was left out is logged. A signal
    waits for the copy; a disk that cannot take it keeps the outputs whole (CollectError)."""
    if outputs.is_symlink():
        logger.warning(
            "outputs is a link (to %s), not the job's folder: nothing of it was copied to the"
            " artifacts",
            os.readlink(outputs),
        )
        return
    if not outputs.is_dir():
        return
    # A completed job's outputs are not cut short by Ctrl-C: teardown (which removes the
    # workspace) runs after the copy.
    with signals_held("the job's outputs are copied to the artifacts"):
        try:
            left_out = copy_outputs(outputs, out / "outputs", redact)
        except OSError as exc:  # a full or read-only artifacts disk: collect names it
            raise OutputsKept(exc, keep_whole(outputs, gpuflow_home() / "kept")) from None
    for left in left_out:
        logger.warning("outputs/%s was not copied to the artifacts", left)


def _job_figures(result_file: Path, logger: Any) -> dict[str, Any]:
    """Return the figures of the job's result.json (one JSON object; its text made
    printable), {} without one or for one over RESULT_LIMIT (kept, not shown)."""
    if not result_file.is_file():
        return {}
    if result_file.stat().st_size > RESULT_LIMIT:
        logger.warning(
            "outputs/result.json is %.1f MiB: gpuflow shows the figures of a result.json of"
            " up to %d MiB; it is in the artifacts, its figures are not shown (write large"
            " data to other files)",
            result_file.stat().st_size / 2**20,
            RESULT_LIMIT // 2**20,
        )
        return {}
    try:
        figures = json.loads(result_file.read_text(errors="replace"))
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser
        raise CollectError(f"the job wrote an unreadable result.json: {exc}") from None
    if not isinstance(figures, dict):
        raise CollectError(
            "the job wrote a result.json that is not a JSON object: write its figures as"
            ' {"name": value, ...}'
        )
    return secrets.printable_json(figures)  # type: ignore[return-value]


@task(name="collect", cache_policy=NO_CACHE)
def collect(
    spec: JobSpec,
    cluster: Cluster,
    outcome: RunOutcome,
    prices: pricing.PriceTable,
    flow_run_id: str,
    artifacts_dir: str,
    earlier: list[Use] | None = None,
    candidate: str | None = None,
) -> RunMetrics:
    """Return the run's metrics and write its artifacts: samples, PNG, Prometheus text,
    the job's outputs; push to the Pushgateway when one is configured. A run placed on a
    list of candidates adds what the `earlier` candidates it used held and cost (this
    one is `candidate`). A folder that cannot be written (a full disk) is one sentence
    that names it; the job's own end is kept in that sentence."""
    try:
        return _collect(
            spec, cluster, outcome, prices, flow_run_id, artifacts_dir, earlier, candidate
        )
    except OSError as exc:
        code = outcome.result.exit_code
        kept = f"; its outputs are kept whole in {exc.kept}" if isinstance(exc, OutputsKept) else ""
        raise CollectError(
            f"the run's artifacts could not be written to {artifacts_dir} ({exc.strerror or exc});"
            " free space there or set storage.artifacts to another folder. The job itself"
            f" ended with {'exit code ' + str(code) if code is not None else 'a signal'}{kept}."
        ) from None


def _split(
    cluster: Cluster, outcome: RunOutcome, metrics: RunMetrics, earlier: list[Use], candidate: str
) -> RunMetrics:
    """Return the metrics with the GPU-hours and cost of every candidate the run used
    (earlier ones from their making to their teardown, this one for the job's run)."""
    last = {
        "candidate": candidate,
        "backend": cluster.backend,
        "ended": outcome.ended,
        "gpu_hours": round(metrics.gpu_hours, 6),
        "usd_per_hour": round(metrics.cost_hourly_usd, 4),
        "cost_usd": round(metrics.cost_usd, 6),
    }
    rows = [*(use.row() for use in earlier), last]
    return metrics.model_copy(
        update={
            "by_placement": rows,
            "gpu_hours": sum(r["gpu_hours"] for r in rows),
            "cost_usd": sum(r["cost_usd"] for r in rows),
        }
    )


def _collect(
    spec: JobSpec,
    cluster: Cluster,
    outcome: RunOutcome,
    prices: pricing.PriceTable,
    flow_run_id: str,
    artifacts_dir: str,
    earlier: list[Use] | None,
    candidate: str | None,
) -> RunMetrics:
    logger = get_run_logger()
    out = Path(artifacts_dir)
    make_dirs(out)  # this user's alone under GPUFLOW_HOME; elsewhere as the user makes folders
    samples_path = Path(cluster.workspace) / SAMPLES
    samples = read_samples(samples_path)
    if samples_path.exists():
        shutil.copyfile(samples_path, out / "samples.jsonl")
    redact = secrets.Redactor(secrets.resolve(spec.secret_env).values())
    _copy_outputs(Path(cluster.workspace) / "outputs", out, redact, logger)
    job_result = _job_figures(out / "outputs" / "result.json", logger)
    idle = spec.limits.idle_gpu
    held_s = outcome.held_s if outcome.held_s is not None else outcome.result.duration_s
    metrics = summarise(
        samples,
        outcome.result.duration_s,
        len(cluster.gpu_indices),
        cost_of(spec, cluster, prices, held_s),
        idle_pct=idle.below_pct if idle is not None else IDLE_PCT,
        held_s=held_s,
    ).model_copy(update={"job": job_result, "image": spec.image.pinned if spec.image else None})
    metrics, figures = _log_figures(metrics, flow_run_id, out)
    if candidate is not None:
        metrics = _split(cluster, outcome, metrics, earlier or [], candidate)
    (out / "metrics.json").write_text(metrics.model_dump_json(indent=2))
    ended = outcome.ended
    text = exposition(samples[-1] if samples else None, metrics, flow_run_id, spec.name, ended)
    (out / "metrics.prom").write_text(text)
    title = f"{spec.name} {flow_run_id[:8]}"
    png = utilisation_png(samples, out / "utilisation.png", title) if spec.metrics.plot else None
    pushed = _push(spec, metrics, flow_run_id, ended, logger)
    kind_report = kind_of(spec).report(spec, cluster, out, title)
    curves = _publish_figures(spec, figures, out, title)
    publish(
        create_table_artifact,
        key="gpuflow-metrics",
        table=_metric_rows(spec, cluster, metrics, ended) + kind_report.rows,
        description=f"Metrics for {spec.name}",
    )
    lines = _summary(spec, cluster, outcome, metrics, out, kind_report.headline)
    if png:
        lines.append(picture("utilisation plot", png))
    if metrics.from_log:
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.from_log.items())
        lines.append(f"- from the job's log ({metrics.from_log_rows} rows), last: {shown}")
    if curves:
        lines.append(picture("the job's figures", curves))
    lines += kind_report.lines
    if pushed:
        lines.append(f"- pushed to {pushed}")
    if outcome.failure:
        lines.append(f"- failure: {outcome.failure}")
    publish(
        create_markdown_artifact,
        key="gpuflow-summary",
        markdown="\n".join(lines),
        description=spec.name,
    )
    rows_file(flow_run_id).unlink(missing_ok=True)
    return metrics


def _log_figures(
    metrics: RunMetrics, flow_run_id: str, out: Path
) -> tuple[RunMetrics, list[dict[str, float]]]:
    """Return the metrics with the job's own figures (metrics.from_log) and their rows,
    copied into the artifacts."""
    figures_file = rows_file(flow_run_id)
    figures = read_rows(figures_file)
    if not figures:
        return metrics, []
    shutil.copyfile(figures_file, out / LOG_METRICS)
    update = {"from_log": last_values(figures), "from_log_rows": len(figures)}
    return metrics.model_copy(update=update), figures


def _publish_figures(
    spec: JobSpec, figures: list[dict[str, float]], out: Path, title: str
) -> Path | None:
    """Publish the job's own figures as a table artifact; return their plot, if drawn."""
    if not figures:
        return None
    publish(
        create_table_artifact,
        key="gpuflow-log-metrics",
        table=table(figures),
        description=f"{spec.name}: the figures its log printed (metrics.from_log)",
    )
    return curves_png(figures, out / "log_metrics.png", title) if spec.metrics.plot else None


def _push(
    spec: JobSpec, metrics: RunMetrics, flow_run_id: str, ended: str, logger: Any
) -> str | None:
    """Push the run's totals (no GPU gauges) to the Pushgateway, when one is set, and
    remove its live group; return where they went (None: not pushed, said why)."""
    if not spec.metrics.pushgateway:
        return None
    try:
        totals = exposition(None, metrics, flow_run_id, spec.name, ended)
        pushed = push(spec.metrics.pushgateway, totals, flow_run_id, spec.name)
        delete(spec.metrics.pushgateway, flow_run_id, spec.name, "run")
        if spec.metrics.from_log:
            delete(spec.metrics.pushgateway, flow_run_id, spec.name, "log")
        return pushed
    except TransientError as exc:
        logger.warning("metrics not pushed: %s", exc)
        return None


def _metric_rows(
    spec: JobSpec, cluster: Cluster, metrics: RunMetrics, ended: str
) -> list[dict[str, Any]]:
    """Return the metrics table's rows: the run's figures, the job's, and what the cost
    report groups by."""
    rows = [
        {"metric": k, "value": v}
        for k, v in metrics.model_dump(
            exclude={"job", "cost_breakdown", "by_placement", "from_log"}
        ).items()
    ]
    rows += [{"metric": f"job.{k}", "value": v} for k, v in metrics.job.items()]
    rows += [{"metric": f"log.{k}", "value": v} for k, v in metrics.from_log.items()]
    rows += [
        {"metric": "run.job", "value": spec.name},
        {"metric": "run.backend", "value": cluster.backend},
        {"metric": "run.host", "value": cluster.hostname},
        {"metric": "run.gpu_product", "value": _product(cluster)},
        {"metric": "run.outcome", "value": ended},
    ]
    return rows


def _summary(
    spec: JobSpec,
    cluster: Cluster,
    outcome: RunOutcome,
    metrics: RunMetrics,
    out: Path,
    headline: list[str],
) -> list[str]:
    """Return the summary's first lines: how the run ended, the kind's headline, its
    GPUs, cost and artifacts, and what each candidate it used held and cost."""
    gpus = ", ".join(cluster.gpu_products) or "none"
    return [
        f"# {spec.name}: {outcome.ended}",
        "",
        *headline,
        f"- duration: {outcome.result.duration_s:.1f} s, exit code {outcome.result.exit_code}",
        f"- GPUs: {len(cluster.gpu_indices)} ({gpus}) on {cluster.hostname};"
        f" {metrics.note or 'GPU metrics sampled'}",
        f"- cost: ${metrics.cost_usd:.4f} at ${metrics.cost_hourly_usd:.4f}/h",
        *([f"- image: `{spec.image.pinned}`"] if spec.image else []),
        f"- artifacts: `{out}`",
        *(
            f"- on {r['candidate']} ({r['ended']}): {r['gpu_hours']:.4f} GPU-hours,"
            f" ${r['cost_usd']:.4f} at ${r['usd_per_hour']:.4f}/h"
            for r in metrics.by_placement
        ),
    ]
