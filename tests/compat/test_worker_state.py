"""compat.worker_state: Celery's shutdown handlers set the globals compat reads, to an exit code that may be 0."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery.apps.worker import install_worker_term_handler
from celery.exceptions import WorkerShutdown, WorkerTerminate
from celery.worker import state as worker_state

from celery_durable.compat.worker_state import raise_if_shutdown_requested, shutdown_requested


@pytest.fixture(autouse=True)
def no_shutdown_yet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both flags unset, put back after the test; so is the spare signal's handler."""
    monkeypatch.setattr(worker_state, "should_stop", None)
    monkeypatch.setattr(worker_state, "should_terminate", None)
    previous = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, previous)


def test_worker_state_flags_are_none_until_a_shutdown() -> None:
    assert not shutdown_requested()
    raise_if_shutdown_requested()  # nothing to raise


def test_worker_state_should_stop_is_set_to_exit_code_zero_by_a_warm_shutdown() -> None:
    # Celery's SIGTERM handler, installed on a spare signal and called as the signal would call it.
    install_worker_term_handler(SimpleNamespace(hostname="compat@test"), sig="SIGUSR2", verbose=False)
    signal.getsignal(signal.SIGUSR2)(signal.SIGUSR2, None)
    assert worker_state.should_stop == 0 and worker_state.should_stop is not False
    assert shutdown_requested()
    with pytest.raises(WorkerShutdown):
        raise_if_shutdown_requested()


def test_worker_state_should_terminate_counts_once_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold shutdown's handler also cancels the running tasks: its flag is set as Celery sets it.
    monkeypatch.setattr(worker_state, "should_terminate", 1)
    assert shutdown_requested()
    with pytest.raises(WorkerTerminate):
        raise_if_shutdown_requested()
