"""What every command shares (gpuflow.session): loading modules without collecting."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from gpuflow import session


def test_loading_turns_collection_off_for_its_body_and_on_again_however_it_ends():
    assert gc.isenabled()
    with session.loading():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), session.loading():
        import gpuflow_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_loading_freezes_what_its_body_made_and_leaves_collection_off_when_it_was():
    gc.unfreeze()
    try:
        with session.loading():
            made = [object() for _ in range(1000)]  # noqa: F841 - kept alive while frozen
        assert gc.get_freeze_count() > 0  # the objects made so far are never scanned again
        gc.disable()
        with session.loading():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_server_starts_without_collecting_and_collects_again_once_it_answers():
    """gpuflow's Prefect server turns collection off for its start-up only: on again once
    uvicorn says it started (or it is told to exit before that)."""
    import time

    from gpuflow.tasks.platform.server import _collect_once_started

    class Server:
        started = False
        should_exit = False

    def on_after(server: Server, flip: str) -> bool:
        _collect_once_started(server)
        assert not gc.isenabled()  # starting: off
        setattr(server, flip, True)
        deadline = time.monotonic() + 30
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        return gc.isenabled()

    try:
        assert on_after(Server(), "started")
        assert on_after(Server(), "should_exit")
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_module_run_through_loading_gets_its_own_command_line_and_exit_code(tmp_path):
    """`python -m gpuflow.tasks.loading MODULE ARGS` (how torchrun and the training ranks
    start): MODULE's main() sees ARGS as its command line, collection is on again by then,
    and what main() returns is the exit code."""
    (tmp_path / "prog.py").write_text(
        "import gc, sys\n\ndef main():\n    print(sys.argv, gc.isenabled())\n    return 3\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.tasks.loading", "prog", "a", "--b"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "['prog', 'a', '--b'] True"
