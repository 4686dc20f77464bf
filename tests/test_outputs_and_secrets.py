"""Copying a job's outputs without following links out of them; masking secrets that are
not one plain line."""

from __future__ import annotations

import json
import os

import pytest

from tasks.outputs import copy_outputs
from tasks.secrets import Redactor, as_env_value


def test_links_are_never_followed_out_of_the_outputs(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private.txt").write_text("not the job's")
    source = tmp_path / "outputs"
    (source / "sub").mkdir(parents=True)
    (source / "model.bin").write_bytes(b"weights")
    (source / "sub" / "log.txt").write_text("log")
    os.symlink(source / "model.bin", source / "latest.bin")  # inside: copied as a file
    os.symlink(outside, source / "escape")  # a folder outside
    os.symlink(outside / "private.txt", source / "private.txt")  # a file outside
    os.symlink(source, source / "sub" / "loop")  # a loop
    os.symlink(source / "gone", source / "dangling")
    os.mkfifo(source / "pipe")  # reading it would block for ever
    target = tmp_path / "artifacts"
    skipped = copy_outputs(source, target, lambda text: text)
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == ["latest.bin", "model.bin", "sub/log.txt"]
    assert not any(p.is_symlink() for p in target.rglob("*"))
    assert (target / "latest.bin").read_bytes() == b"weights"
    assert sorted(skipped) == [
        "dangling (a link out of the outputs)",
        "escape (a link to a folder)",
        "pipe (not a regular file)",
        "private.txt (a link out of the outputs)",
        "sub/loop (a link to a folder)",
    ]


def test_error_and_result_files_are_copied_masked(tmp_path):
    source = tmp_path / "outputs"
    source.mkdir()
    (source / "error.txt").write_text("bad token tok-123456")
    (source / "result.json").write_text('{"note": "tok-123456"}')
    (source / "other.txt").write_text("tok-123456")  # the job's own file: the job's business
    copy_outputs(source, tmp_path / "a", Redactor(["tok-123456"]))
    assert (tmp_path / "a" / "error.txt").read_text() == "bad token ***"
    assert json.loads((tmp_path / "a" / "result.json").read_text()) == {"note": "***"}
    assert (tmp_path / "a" / "other.txt").read_text() == "tok-123456"


SECRET_CASES = {
    "plain": ("hunter2-secret", "pw hunter2-secret", "pw ***"),
    "second line alone": ("line-one-aaaa\nline-two-bbbb", "x line-two-bbbb", "x ***"),
    "first line alone": ("line-one-aaaa\nline-two-bbbb", "line-one-aaaa!", "***!"),
    "whole value": ("line-one-aaaa\nline-two-bbbb", "line-one-aaaa\nline-two-bbbb", "***"),
    "json leaf": ('{"api_key": "ak-55aa66bb"}', "key=ak-55aa66bb", "key=***"),
    "nested json leaf": ('{"a": {"b": ["tk-77cc88dd"]}}', "tk-77cc88dd", "***"),
    "json number": ('{"pin": 98765432}', "pin 98765432", "pin ***"),
    "short pieces kept": ('{"on": true, "n": "ab"}', "on ab true", "on ab true"),
}


@pytest.mark.parametrize("case", list(SECRET_CASES))
def test_redactor_masks_every_line_and_leaf(case):
    secret, text, expected = SECRET_CASES[case]
    assert Redactor([secret])(text) == expected


def test_json_secrets_reach_the_job_as_json():
    assert json.loads(as_env_value({"api_key": "x", "n": 1})) == {"api_key": "x", "n": 1}
    assert as_env_value("plain text") == "plain text"
