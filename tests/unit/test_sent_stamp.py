"""Every task message an app with celery_durable installed sends carries its send time."""

from __future__ import annotations

from time import time

from celery import Celery

import celery_durable
from celery_durable.headers import SENT_AT_HEADER


def test_send_task_and_apply_async_stamp_the_send_time_and_a_resend_stamps_anew():
    app = celery_durable.install(Celery("stamp", broker="memory://", set_as_current=False))

    @app.task(name="stamp.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue("stamp-q")
        before = time()
        add.apply_async((1, 2), queue="stamp-q")
        app.send_task("stamp.add", (3, 4), queue="stamp-q", headers={SENT_AT_HEADER: 1.0})
        first, second = queue.get(timeout=1), queue.get(timeout=1)
        after = time()
        for message in (first, second):
            assert before <= message.headers[SENT_AT_HEADER] <= after
            message.ack()
        queue.close()
    app.close()
