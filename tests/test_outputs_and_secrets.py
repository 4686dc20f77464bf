"""Copying a job's outputs without following links out of them; masking secrets that are
not one plain line."""

from __future__ import annotations

import json
import os

import pytest

from gpuflow.tasks.outputs import copy_outputs
from gpuflow.tasks.secrets import Redactor, as_env_value


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


def test_modes_are_kept_never_widened_and_hard_links_out_are_left_out(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's")
    source = tmp_path / "outputs"
    source.mkdir()
    (source / "key.pem").write_text("private")
    (source / "key.pem").chmod(0o600)
    (source / "run.sh").write_text("#!/bin/sh\n")
    (source / "run.sh").chmod(0o750)
    (source / "a.txt").write_text("shared inside")
    os.link(source / "a.txt", source / "b.txt")  # two names inside: both copied
    os.link(outside, source / "stolen.txt")  # a name for a file outside: left out
    target = tmp_path / "artifacts"
    skipped = copy_outputs(source, target, lambda text: text)
    assert skipped == ["stolen.txt (a hard link to a file outside the outputs)"]
    assert (target / "key.pem").stat().st_mode & 0o777 == 0o600
    assert (target / "run.sh").stat().st_mode & 0o777 == 0o750
    assert (target / "b.txt").read_text() == "shared inside"
    assert not list(target.glob(".*.part"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user's")
def test_a_file_of_another_user_is_left_out(tmp_path):
    source = tmp_path / "outputs"
    source.mkdir()
    (source / "theirs.txt").write_text("not the job's")
    os.chown(source / "theirs.txt", 65534, 65534)
    skipped = copy_outputs(source, tmp_path / "artifacts", lambda text: text)
    assert skipped == ["theirs.txt (not the job's own file: it belongs to uid 65534)"]


def test_a_full_disk_leaves_no_truncated_file_under_its_final_name(tmp_path):
    """The copy of a 3 MiB file into a 1 MiB tmpfs fails with ENOSPC: the error reaches
    the caller and nothing is left under the file's name."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    source = tmp_path / "outputs"
    source.mkdir()
    (source / "big.bin").write_bytes(os.urandom(3 << 20))
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(OSError) as caught:
            copy_outputs(source, small / "artifacts", lambda text: text)
        assert caught.value.errno == 28  # ENOSPC
        assert sorted(p.name for p in (small / "artifacts").iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


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


PRINTABLE = [
    ("plain text, tabs\tand\nnewlines", "plain text, tabs\tand\nnewlines"),
    ("nul\x00byte", "nul\\x00byte"),
    ("\x1b[2Jcleared", "\\x1b[2Jcleared"),
    ("over\rwritten", "over\\x0dwritten"),
    ("c1 \x9b control", "c1 \\x9b control"),
    ("del\x7f", "del\\x7f"),
    ("lone \udcff surrogate", "lone \\udcff surrogate"),
    ("accents é and 漢字 stay", "accents é and 漢字 stay"),
]


@pytest.mark.parametrize(("text", "shown"), PRINTABLE)
def test_what_a_job_prints_is_made_printable(text, shown):
    from gpuflow.tasks.secrets import printable

    assert printable(text) == shown
    shown.encode("utf-8")  # any database and terminal take it


def test_result_figures_are_made_printable_keys_and_all():
    from gpuflow.tasks.secrets import printable_json

    figures = {"a\x00": ["x\x1by", {"n": 1.5, "ok": True, "s": "\r"}]}
    assert printable_json(figures) == {"a\\x00": ["x\\x1by", {"n": 1.5, "ok": True, "s": "\\x0d"}]}
