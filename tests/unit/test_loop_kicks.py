"""LoopKicks: every callable queued runs, even when one before it raises; a kick made on the loop thread
rides the hub's next round without a byte in the self-pipe, and none waits for the poll's timeout."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu.asynchronous import Hub

from celery_durable.worker.loop_kicks import LoopKicks


class FakeHub:
    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}
        self.on_tick: set[Callable[[], None]] = set()
        self.ready: list[Callable[[], None]] = []

    def add_reader(self, fd: int, callback: Any) -> None:
        self.readers[fd] = callback

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.ready.append(callback)

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
    (run_soon,) = hub.ready
    with pytest.raises(RuntimeError, match="boom"):
        run_soon()
    assert ran == ["after"]
    kicks(lambda: ran.append("next round"))
    hub.ready[-1]()
    assert ran == ["after", "next round"]
    kicks.close()
    assert not hub.on_tick and not hub.readers


# -- on kombu's own hub -----------------------------------------------------------------
@pytest.fixture
def hub() -> Iterator[Hub]:
    hub = Hub()
    yield hub
    hub.close()


class PipeSpy:
    """Counts the bytes written to a LoopKicks' self-pipe (read back before the hub's reader drains them)."""

    def __init__(self, kicks: LoopKicks, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes = 0
        real_write = os.write
        write_fd = kicks._write_fd

        def write(fd: int, data: bytes) -> int:
            if fd == write_fd:
                self.writes += 1
            return real_write(fd, data)

        monkeypatch.setattr("celery_durable.worker.loop_kicks.os.write", write)


def _event_source(hub: Hub, on_event: Callable[[], None]) -> Callable[[], None]:
    """A pipe the hub polls, as prefork's result reader is polled; returns what makes it readable."""
    read_fd, write_fd = os.pipe()

    def readable() -> None:
        os.read(read_fd, 1)
        on_event()

    hub.add_reader(read_fd, readable)
    return lambda: os.write(write_fd, b"r")


def _rounds_until(loop: Iterator[None], done: Callable[[], bool], *, limit: int = 10) -> None:
    for _ in range(limit):
        next(loop)
        if done():
            return
    raise AssertionError(f"not done after {limit} rounds")


class Kicked:
    """Kicks that record when each was made and when its callable ran (a kick left to the poll's timeout, ~1 s
    with no timer due, shows as a late run)."""

    def __init__(self, kicks: LoopKicks, hub: Hub) -> None:
        self.kicks = kicks
        self.made: dict[str, float] = {}
        self.ran: dict[str, float] = {}
        # Ends the poll of the round a callable ran in: the test steps on at once, and the delay it
        # measures (made -> ran) ends before that poll anyway.
        self._end_poll = _event_source(hub, lambda: None)

    def kick(self, name: str, then: Callable[[], None] = lambda: None) -> None:
        self.made[name] = time.monotonic()

        def run() -> None:
            self.ran[name] = time.monotonic()
            self._end_poll()
            then()

        self.kicks(run)

    def delay(self, name: str) -> float:
        return self.ran[name] - self.made[name]


def test_a_kick_from_an_event_callback_runs_next_round_without_writing_the_pipe(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    kicks = LoopKicks(hub)
    spy = PipeSpy(kicks, monkeypatch)
    kicked = Kicked(kicks, hub)
    names = iter(["a", "b", "c"])
    fire = _event_source(hub, lambda: kicked.kick(next(names)))
    loop = hub.create_loop()
    for name in ("a", "b", "c"):
        fire()
        _rounds_until(loop, lambda: name in kicked.ran)  # noqa: B023 - called before the next iteration
        assert kicked.delay(name) < 0.5
    assert spy.writes == 0
    kicks.close()


def test_a_kick_from_a_timer_or_a_kicked_callable_still_wakes_the_poll(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the hub's queued callables ran, only the pipe ends the poll before its timeout (a second)."""
    kicks = LoopKicks(hub)
    spy = PipeSpy(kicks, monkeypatch)
    kicked = Kicked(kicks, hub)
    fire = _event_source(hub, lambda: kicked.kick("first", then=lambda: kicked.kick("again")))
    loop = hub.create_loop()
    fire()
    _rounds_until(loop, lambda: "again" in kicked.ran)
    assert kicked.delay("again") < 0.5
    assert spy.writes == 1

    hub.call_later(0, lambda: kicked.kick("from a timer"))
    _rounds_until(loop, lambda: "from a timer" in kicked.ran)
    assert kicked.delay("from a timer") < 0.5
    assert spy.writes == 2
    kicks.close()


def test_a_kick_from_another_thread_wakes_the_poll(hub: Hub) -> None:
    kicks = LoopKicks(hub)
    kicked = Kicked(kicks, hub)
    loop = hub.create_loop()
    thread = threading.Thread(target=lambda: kicked.kick("from a thread"))
    thread.start()
    thread.join()
    _rounds_until(loop, lambda: "from a thread" in kicked.ran)
    assert kicked.delay("from a thread") < 0.5
    kicks.close()
