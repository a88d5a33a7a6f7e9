"""LoopKicks: every callable queued runs, even when one before it raises."""

from __future__ import annotations

from typing import Any

import pytest

from celery_durable.worker.loop_kicks import LoopKicks


class FakeHub:
    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}

    def add_reader(self, fd: int, callback: Any) -> None:
        self.readers[fd] = callback

    def remove(self, fd: int) -> None:
        self.readers.pop(fd, None)


def test_a_callable_that_raises_does_not_drop_the_ones_queued_after_it() -> None:
    hub = FakeHub()
    kicks = LoopKicks(hub)
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    kicks(broken)
    kicks(lambda: ran.append("after"))
    (run_pending,) = hub.readers.values()
    with pytest.raises(RuntimeError, match="boom"):
        run_pending()
    assert ran == ["after"]
    kicks(lambda: ran.append("next round"))
    run_pending()
    assert ran == ["after", "next round"]
    kicks.close()
