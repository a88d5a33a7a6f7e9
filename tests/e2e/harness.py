"""Runs real ``celery worker`` processes against a real broker and reads what their tasks recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from tests.e2e.waiting import wait_for
from tests.e2e.worker_control import RemoteControlled
from tests.faultproxy import FaultProxy
from tests.services import OBSERVE_URL

REPO = Path(__file__).resolve().parents[2]

#: The log files of the processes the current test started (tests/e2e/conftest.py attaches their
#: tails to a failed test's report: CI keeps no files, only what pytest prints).
STARTED_LOGS: list[Path] = []
#: The title of those tails in a report's sections (the root conftest prints each one's last lines at the end).
E2E_LOG_SECTION = "e2e log"


@dataclass
class Scenario:
    """One test's broker, unique queue names and event list."""

    broker_kind: str
    broker_url: str
    queue_names: Sequence[str]
    key: str = field(default_factory=lambda: f"e2e:{uuid.uuid4().hex}")
    #: The test's own proxy in front of the broker, when ``broker_url`` goes through one.
    proxy: FaultProxy | None = None

    def __post_init__(self) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.queues = [f"{name}-{suffix}" for name in self.queue_names]
        self.by_name = dict(zip(self.queue_names, self.queues))
        self.observer = redis.Redis.from_url(OBSERVE_URL)
        self.producer = Celery("e2e-producer", broker=self.broker_url)
        self.producer.conf.broker_connection_retry_on_startup = True
        self._workers: list[WorkerProcess | BeatProcess] = []

    def reconnect_producer(self) -> None:
        """A fresh producer app, for after the broker closed every connection."""
        from kombu import pools

        # kombu pools connections process-wide by URL: drop the dead ones.
        pools.reset()
        self.producer = Celery("e2e-producer", broker=self.broker_url)
        self.producer.conf.broker_connection_retry_on_startup = True

    # -- sending ---------------------------------------------------------------
    def send(self, queue_name: str, label: str, seconds: float = 0.0, **options: Any) -> str:
        result = self.producer.send_task(
            "e2e.record", args=[label, seconds], queue=self.by_name[queue_name], **options
        )
        return str(result.id)

    def send_task(self, queue_name: str, name: str, args: Sequence[Any] = (), **options: Any) -> str:
        """Send any task by name (registered in the workers' app or not) to one of this test's queues."""
        result = self.producer.send_task(name, args=list(args), queue=self.by_name[queue_name], **options)
        return str(result.id)

    def send_waiting(self, queue_name: str, label: str, gate: str = "gate", **options: Any) -> str:
        """Send ``e2e.wait``: it starts, then runs until ``open_gate(gate)`` lets it end."""
        return self.send_task(queue_name, "e2e.wait", [label, gate], **options)

    def open_gate(self, gate: str = "gate", count: int = 1) -> None:
        """Let ``count`` ``e2e.wait`` runs waiting on ``gate`` (now or later) end."""
        self.observer.rpush(f"{self.key}:gate:{gate}", *["open"] * count)

    # -- reading what ran ------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.observer.lrange(self.key, 0, -1)]

    def started(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["e"] == "start"]

    def ended(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["e"] == "end"]

    def labelled(self, event: str, prefix: str) -> list[dict[str, Any]]:
        """The ``event`` events ("start", "end", ...) of runs whose label starts with ``prefix``."""
        return [e for e in self.events() if e["e"] == event and e["label"].startswith(prefix)]

    def wait_ended(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        wait_for(lambda: len(self.ended()) >= count, timeout=timeout, what=f"{count} tasks to end")
        return self.ended()

    def max_concurrency(self, events: Iterable[dict[str, Any]] | None = None,
                        only: Callable[[dict[str, Any]], bool] = lambda e: True) -> int:
        """Most tasks running at once, from the start/end events in the order Redis got them."""
        running = peak = 0
        for event in events if events is not None else self.events():
            if not only(event):
                continue
            running += 1 if event["e"] == "start" else -1
            peak = max(peak, running)
        return peak

    # -- the broker's side ---------------------------------------------------------
    def broker_depth(self, queue_name: str) -> int:
        queue = self.by_name[queue_name]
        if self.broker_kind == "redis":
            client = redis.Redis.from_url(self.broker_url)
            # kombu keeps priorities 0 and 3/6/9 in separate lists.
            sep = "\x06\x16"
            return sum(int(client.llen(name)) for name in
                       [queue] + [f"{queue}{sep}{p}" for p in (3, 6, 9)])
        with self.producer.connection_for_write() as conn:
            _, count, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
            return int(count)

    # -- workers ---------------------------------------------------------------------
    def worker(self, *, conf: dict[str, Any] | None = None, queues: Sequence[str] | None = None,
               pool: str | None = "durable", concurrency: int | None = 2,
               extra_args: Sequence[str] = (), app: str = "tests.e2e.e2eapp",
               broker_url: str | None = None, env: dict[str, str] | None = None) -> WorkerProcess:
        """``pool=None`` leaves out ``-P`` (the app's ``worker_pool`` decides); ``broker_url`` replaces
        the scenario's for this worker alone (e.g. through a fault proxy); ``env``: more environment."""
        names = list(queues) if queues is not None else list(self.queue_names)
        worker = WorkerProcess(self, [self.by_name[n] for n in names], conf or {}, pool,
                               concurrency, list(extra_args), app=app, broker_url=broker_url, env=env)
        self._workers.append(worker)
        return worker

    def beat(self, *, conf: dict[str, Any] | None = None, entries: dict[str, Any] | None = None,
             app: str = "tests.e2e.beatapp", extra_args: Sequence[str] = (),
             scheduler: str = "celery_durable.Scheduler") -> BeatProcess:
        """A ``celery beat -S celery_durable.Scheduler`` replica of ``app`` (tests/e2e/beatapp.py); with
        ``scheduler="celery.beat:PersistentScheduler"``, stock beat (its own schedule file)."""
        beat = BeatProcess(self, conf or {}, entries or {}, app=app, extra_args=list(extra_args),
                           scheduler=scheduler)
        self._workers.append(beat)  # killed at cleanup like a worker
        return beat

    def cleanup(self) -> None:
        for worker in self._workers:
            worker.kill()
        self.observer.delete(self.key)
        extra = list(self.observer.scan_iter(match=f"{self.key}:*"))
        if extra:
            self.observer.delete(*extra)
        try:
            if self.broker_kind == "redis":
                client = redis.Redis.from_url(self.broker_url)
                for queue in self.queues:
                    client.delete(queue, *[f"{queue}\x06\x16{p}" for p in (3, 6, 9)])
            else:
                with self.producer.connection_for_write() as conn:
                    for queue in self.queues:
                        conn.default_channel.queue_delete(queue)
        except Exception:  # noqa: BLE001 - best effort; queue names are unique per test anyway
            pass


def _child_env(scenario: Scenario, conf: dict[str, Any], broker_url: str | None, **extra: str) -> dict[str, str]:
    """The environment an app of tests/e2e reads its broker, queues, settings and event list from."""
    env = dict(os.environ)
    env.update(
        E2E_BROKER=broker_url or scenario.broker_url,
        E2E_QUEUES=",".join(scenario.queues),
        E2E_CONF=json.dumps(conf),
        E2E_KEY=scenario.key,
        E2E_OBSERVE=OBSERVE_URL,
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        **extra,
    )
    return env


class WorkerProcess(RemoteControlled):
    """A ``celery -A tests.e2e.e2eapp worker`` subprocess (or of another ``app`` module)."""

    def __init__(self, scenario: Scenario, queues: list[str], conf: dict[str, Any], pool: str | None,
                 concurrency: int | None, extra_args: list[str], *,
                 app: str = "tests.e2e.e2eapp", broker_url: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.scenario = scenario
        self.name = f"w{uuid.uuid4().hex[:6]}@%h"
        self.log_path = Path(os.environ.get("E2E_LOG_DIR", "/tmp")) / f"e2e-{uuid.uuid4().hex[:8]}.log"
        env = _child_env(scenario, conf, broker_url, **(env or {}))
        args = [sys.executable, "-m", "celery", "-A", app, "worker",
                *(["-P", pool] if pool is not None else []), "-Q", ",".join(queues), "-n", self.name,
                "--without-mingle", "--without-gossip", "-l", "info", *extra_args]
        if concurrency is not None:
            args += ["-c", str(concurrency)]
        self._log = open(self.log_path, "wb")
        STARTED_LOGS.append(self.log_path)
        self.process = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._broker_url = broker_url or scenario.broker_url
        self._transport_options = conf.get("broker_transport_options")
        self._own_control: Celery | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait for the ready line, then for the worker to answer ``ping``.

        The ready line is logged before the remote-control mailbox is surely listening: on Redis the
        broadcast is a PUBLISH, and one sent before kombu's SUBSCRIBE has reached Redis is dropped (stop
        21's CI failed on an ``inspect stats`` sent just then). A test that inspects a ready worker needs
        the mailbox, so ready means both.
        """
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            return " ready." in self.log()
        wait_for(ready, timeout=timeout, what="the worker to be ready", every=0.05)
        if not self.has_remote_control:
            return self
        # A ping sent before the mailbox listens goes unanswered, its whole timeout waited out; a listening
        # one answers in ms. So the first pings wait briefly, then 1 s each, as a loaded machine may need.
        ping_timeouts = iter([0.2, 0.5])
        wait_for(lambda: ready() and self.answers_ping(next(ping_timeouts, 1.0)),
                 timeout=max(deadline - time.monotonic(), 1.0), what="the ready worker to answer ping",
                 every=0.05)
        return self

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a warm shutdown) and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._log.close()
            self._close_control()

    def kill(self) -> None:
        """SIGKILL the worker and its pool children (as a crash would)."""
        if self.process.poll() is None:
            children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
            self.process.kill()
            for pid in children.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait(timeout=30)
        self._log.close()
        self._close_control()


class BeatProcess:
    """A ``celery -A tests.e2e.beatapp beat -S celery_durable.Scheduler`` subprocess: one replica."""

    def __init__(self, scenario: Scenario, conf: dict[str, Any], entries: dict[str, Any], *, app: str,
                 extra_args: list[str], scheduler: str = "celery_durable.Scheduler") -> None:
        self.scenario = scenario
        self.log_path = Path(os.environ.get("E2E_LOG_DIR", "/tmp")) / f"e2e-beat-{uuid.uuid4().hex[:8]}.log"
        env = _child_env(scenario, conf, None, E2E_BEAT=json.dumps(entries))
        self.durable = scheduler == "celery_durable.Scheduler"
        args = [sys.executable, "-m", "celery", "-A", app, "beat", "-S", scheduler, "-l", "info", *extra_args]
        if not self.durable and "-s" not in extra_args:  # stock beat keeps its schedule in a file of its own
            args += ["-s", str(self.log_path.with_suffix(".schedule"))]
        self._log = open(self.log_path, "wb")
        STARTED_LOGS.append(self.log_path)
        self.process = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def holder(self) -> str | None:
        """This replica's lease token, from its start-up line (None before it logged one)."""
        for line in self.log().splitlines():
            if "durable.beat.started" in line:
                return line.split("holder=")[1].split()[0]
        return None

    def wait_started(self, timeout: float = 30.0) -> BeatProcess:
        def started() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"beat exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            return self.holder is not None if self.durable else "beat: Starting..." in self.log()
        wait_for(started, timeout=timeout, what="the beat replica to start", every=0.05)
        return self

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped replica must die too
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()

