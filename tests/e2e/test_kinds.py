"""A job kind defined here, in the tests, runs through the pipeline, the CLI and the local
backend with no change to stages, flows or the CLI: the registry is the only seam."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from gpuflow.tasks.contract import Capabilities, Cluster, WorkUnit
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.kinds.registry import register, unregister
from gpuflow.tasks.spec import JobSpec
from tests.e2e.helpers import artifacts_of, logs_of, nothing_left

pytestmark = pytest.mark.e2e

# Each unit counts its share of the words and writes the count where the job's outputs go.
COUNT = (
    "import json, os, sys; words = sys.argv[1:]; print(f'{len(words)} words:', *words);"
    " out = os.environ['GPUFLOW_OUTPUT_DIR'];"
    " json.dump({'count': len(words)}, open(f\"{out}/{os.environ['TOY_PART']}.json\", 'w'))"
)


class WordsJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["words"] = "words"
    words: list[str]


class WordsKind(JobKind):
    """Two units, each counting half of the words; the report adds them up."""

    name = "words"
    model = WordsJob

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        if not spec.job.words:
            raise InvalidSpec("job.words is empty; give at least one word to count")

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        return [{"name": "words", "level": "pass", "message": f"{len(spec.job.words)} words"}]

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        words = spec.job.words
        halves = {"left": words[: len(words) // 2], "right": words[len(words) // 2 :]}
        return [
            WorkUnit(
                name=part, command=[sys.executable, "-c", COUNT, *half], env={"TOY_PART": part}
            )
            for part, half in halves.items()
        ]

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        counts = [
            json.loads(p.read_text())["count"] for p in (artifacts / "outputs").glob("*.json")
        ]
        return Report(
            rows=[{"metric": "words.counted", "value": sum(counts)}],
            lines=[f"- words: {sum(counts)}"],
        )

    def summary(self, job: dict[str, Any]) -> list[str]:
        return ["  words counted in two units"]


def table(artifact: Any) -> list[dict[str, Any]]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


@pytest.fixture
def words_kind():
    kind = register(WordsKind())
    yield kind
    unregister("words")


def test_a_kind_from_the_tests_runs_through_the_pipeline(prefect_api, gpuflow_home, words_kind):
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec

    spec = load_spec(
        {"name": "words", "job": {"kind": "words", "words": ["a", "b", "c", "d", "e"]}}
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    outputs = Path(result.artifacts_dir) / "outputs"
    assert json.loads((outputs / "left.json").read_text()) == {"count": 2}
    assert json.loads((outputs / "right.json").read_text()) == {"count": 3}
    run_id = state.state_details.flow_run_id
    artifacts = artifacts_of(run_id)
    assert {"metric": "words.counted", "value": 5} in table(artifacts["gpuflow-metrics"])
    assert "- words: 5" in artifacts["gpuflow-summary"].data
    assert any(row["check"] == "words" for row in table(artifacts["gpuflow-preflight"]))
    logs = "\n".join(logs_of(run_id))
    assert "[left] 2 words: a b" in logs and "[right] 3 words: c d e" in logs


def test_a_kind_from_the_tests_runs_from_the_cli(
    prefect_api, gpuflow_home, words_kind, tmp_path, capsys
):
    from gpuflow.cli import main

    job = tmp_path / "words.yaml"
    job.write_text("name: words\njob: {kind: words, words: [x, y]}\n")
    assert main(["run", str(job)]) == 0
    assert "words counted in two units" in capsys.readouterr().out
    job.write_text("name: words\njob: {kind: words, words: []}\n")
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert "gpuflow: invalid input: job.words is empty; give at least one word" in err
    assert nothing_left(gpuflow_home)  # refused before anything was provisioned


def test_an_unregistered_kind_is_refused_by_name(words_kind):
    from gpuflow.tasks.spec import load_spec

    unregister("words")
    with pytest.raises(
        InvalidSpec, match=r"job\.kind: 'words' is not a job kind; use one of: command"
    ):
        load_spec({"job": {"kind": "words", "words": ["a"]}})
