"""Artifacts are reports beside a run: an API that fails to take one is a warning."""

from __future__ import annotations

import logging

import httpx
import pytest

from gpuflow.tasks.api_client import publish


def refused(**artifact):
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/artifacts/")
    response = httpx.Response(500, request=request)
    raise httpx.HTTPStatusError(
        "Server error '500 Internal Server Error' for url 'http://127.0.0.1:4200/api/artifacts/'\n"
        "Response: {'exception_message': 'Internal Server Error'}",
        request=request,
        response=response,
    )


def test_an_artifact_the_api_refuses_is_a_warning_naming_it_and_the_cause(caplog):
    with caplog.at_level(logging.WARNING, logger="gpuflow"):
        assert publish(refused, key="gpuflow-metrics", table=[{"a": 1}]) is None
    [record] = caplog.records
    assert record.getMessage() == (
        "the artifact gpuflow-metrics could not be published (Server error '500 Internal"
        " Server Error' for url 'http://127.0.0.1:4200/api/artifacts/'); the run goes on"
        " without it"
    )


def test_a_published_artifact_is_what_its_create_returns():
    made: dict = {}

    def create(**artifact):
        made.update(artifact)
        return "artifact-id"

    assert publish(create, key="gpuflow-summary", markdown="# x") == "artifact-id"
    assert made == {"key": "gpuflow-summary", "markdown": "# x"}


def test_what_is_not_the_apis_failure_is_not_hidden():
    def broken(**artifact):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish(broken, key="gpuflow-summary")


def test_a_bug_in_the_artifact_is_not_hidden():
    def wrong(**artifact):
        raise TypeError("table must be a list")

    with pytest.raises(TypeError):
        publish(wrong, key="gpuflow-metrics")
