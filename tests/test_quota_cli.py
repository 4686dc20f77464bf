"""`gpuflow platform quota` and `platform user add --team` on the platform's host: what they
write, and each bad input one sentence before anything is written."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import gpuflow


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_quotas_caps_and_teams_are_written_and_listed(home, capsys):
    assert (
        gpuflow(capsys, "platform", "quota", "set", "vision", "--gpus", "8", "--scope", "gpu:H100")[
            0
        ]
        == 0
    )
    assert gpuflow(capsys, "platform", "quota", "set", "vision", "--gpus", "2")[0] == 0
    assert gpuflow(capsys, "platform", "quota", "cap", "ana", "--gpus", "4")[0] == 0
    code, out, _ = gpuflow(capsys, "platform", "user", "add", "ana", "--team", "vision")
    assert code == 0 and out.startswith("ana:gfu_")
    written = json.loads((home / "platform" / "quotas.json").read_text())
    assert written == {"caps": {"ana": 4}, "teams": {"vision": {"*": 2, "gpu:H100": 8}}}
    code, out, _ = gpuflow(capsys, "platform", "quota", "ls")
    assert "team vision: 8 GPUs gpu:H100; holds 0, borrows 0, 0 run(s) waiting" in out
    code, out, _ = gpuflow(capsys, "platform", "user", "ls")
    assert "ana" in out and "vision" in out
    assert gpuflow(capsys, "platform", "quota", "set", "vision", "--gpus", "0")[0] == 0
    written = json.loads((home / "platform" / "quotas.json").read_text())
    assert written["teams"] == {"vision": {"gpu:H100": 8}}


def test_a_quota_beyond_this_hosts_gpus_is_said_and_allowed(home, capsys):
    code, out, err = gpuflow(capsys, "platform", "quota", "set", "vision", "--gpus", "64")
    assert code == 0 and "team vision: 64 GPUs anywhere" in out
    assert "team vision's 64 GPUs are more than this host's " in err  # 0 here: no GPU
    assert "the quota holds across every backend the platform places on" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["quota", "set", "vision", "--gpus", "-2"], "--gpus -2: a quota is 0 or more GPUs"),
        (["quota", "set", "Vision", "--gpus", "2"], "team name 'Vision' is not 1-63 lower-case"),
        (["quota", "set", "vision", "--gpus", "2", "--scope", "H100"], "--scope 'H100': write *"),
        (["quota", "cap", "ana", "--gpus", "-1"], "--gpus -1: a cap is 0 or more GPUs"),
        (["user", "add", "ana", "--team", "Team A"], "team name 'Team A' is not 1-63"),
        (["user", "add", "ana", "--role", "boss"], "role 'boss' does not exist"),
    ],
)
def test_bad_quota_input_is_one_sentence_and_writes_nothing(home, capsys, argv, said):
    code, _, err = gpuflow(capsys, "platform", *argv)
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert not (home / "platform" / "quotas.json").exists()
    assert not (home / "platform" / "users.json").exists()
