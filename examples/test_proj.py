"""A user's own test of the example app, written with celery_durable's pytest plugin.

``pytest examples/`` runs it: a ``-P durable`` worker on the embedded broker (an
SQLite file), a throw-away durable store, and the run read back.
"""

from __future__ import annotations

from examples.proj import app, fulfil


def test_fulfil_checkpoints_the_charge_and_the_receipt_once(durable_worker, durable_run):
    durable_worker("examples.proj", queues=["default", "emails", "reports"])

    sent = fulfil.delay(7)

    run = durable_run(sent.id, state="succeeded")
    assert [(step.name, step.occurrence) for step in run.steps] == [("charge", 0), ("receipt", 0)]
    assert run.steps[0].result == {"id": "ch_7", "amount": 70}
    assert run.result == {"order": 7, "charge": "ch_7", "receipt": "receipt for order 7 (ch_7)"}
    assert run.attempts == 1


def test_fulfil_in_process_returns_its_result(durable_worker, durable_run):
    durable_worker(app, in_process=True)  # a worker on a thread of this process: no subprocess

    sent = fulfil.delay(8)

    assert sent.get(timeout=30)["charge"] == "ch_8"
    assert durable_run(sent.id, state="succeeded").attempts == 1
