"""WorkerWiring: one record per worker of what boot learned, kept beside Celery's WorkController, not on it."""

from __future__ import annotations

import gc

import pytest

from celery_durable.config import DurableConfig
from celery_durable.worker import wiring
from celery_durable.worker.wiring import CommandLine, WorkerWiring, wire, wiring_for


class Controller:
    """Stands in for Celery's WorkController: any object that can be weakly referenced."""


def test_an_unwired_worker_has_the_empty_record_and_no_config():
    record = wiring_for(Controller())
    assert record == WorkerWiring()
    assert record.command_line == CommandLine() and dict(record.limits) == {}
    with pytest.raises(LookupError, match="not wired"):
        _ = record.durable_config


def test_each_signal_adds_its_part_and_keeps_the_others():
    worker = Controller()
    command_line = CommandLine(concurrency_given=False, overrides={"durable_max_in_flight": 4})
    wire(worker, command_line=command_line)  # celeryd_init
    config = DurableConfig(max_in_flight=4)
    record = wire(worker, config=config, limits={})  # worker_init
    assert record.command_line is command_line and record.durable_config is config
    assert wiring_for(worker) is record


def test_two_workers_keep_apart_records_and_a_gone_worker_takes_its_record_with_it():
    first, second = Controller(), Controller()
    wire(first, config=DurableConfig(max_in_flight=1))
    wire(second, config=DurableConfig(max_in_flight=2))
    assert wiring_for(first).durable_config.max_in_flight == 1
    assert wiring_for(second).durable_config.max_in_flight == 2
    before = len(wiring._wirings)
    del first
    gc.collect()
    assert len(wiring._wirings) == before - 1
