"""What every command shares (gpuflow.session): loading modules without collecting."""

from __future__ import annotations

import gc

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
