"""Stock beat beside the durable beat, side by side: duplicates with two replicas, ticks lost to a restart.

    .venv/bin/python benchmarks/beat_scenario.py [--seconds 20] [--gap 10] [--write PATH]

One entry every second (``beat.tick`` of tests/e2e/beatapp.py), a real ``-P durable`` worker recording
each send it runs, Redis broker, PostgreSQL store:

1. **Two replicas** for ``--seconds``: stock ``celery beat`` twice (each its own schedule file) against
   ``celery beat -S celery_durable.Scheduler`` twice. Duplicates = sends beyond one per tick.
2. **A restart**: one replica runs, is stopped (SIGTERM) for ``--gap`` seconds, and runs again. Lost =
   ticks in the whole window never sent. The durable entry uses ``durable_catch_up: "all"`` (every
   missed tick is sent); the default, ``"skip"``, would send only the latest missed one, by design.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from celery_durable.store.engine import dispose_all, ensure_schema  # noqa: E402
from tests.e2e.harness import Scenario, wait_for  # noqa: E402
from tests.services import broker_url  # noqa: E402
from tests.stores import fresh_store  # noqa: E402

APP = "tests.e2e.beatapp"
STOCK = "celery.beat:PersistentScheduler"
DURABLE = "celery_durable.Scheduler"


def _sends(s: Scenario) -> list[dict[str, Any]]:
    return [e for e in s.events() if e["e"] == "start"]


def _run_for(seconds: float) -> None:
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started >= seconds, timeout=seconds + 5, what=f"{seconds} s", every=0.2)


def _settle(s: Scenario) -> list[dict[str, Any]]:
    """The sends, once the worker has run everything published (no new one for two seconds)."""
    seen = {"count": -1, "since": time.monotonic()}

    def quiet() -> bool:
        count = s.observer.llen(s.key)
        if count != seen["count"]:
            seen.update(count=count, since=time.monotonic())
        return time.monotonic() - seen["since"] >= 2.0

    wait_for(quiet, timeout=30, what="the worker to run what was sent", every=0.2)
    return _sends(s)


def _per_tick(sends: list[dict[str, Any]]) -> dict[int, int]:
    """Sends per tick: the durable ones name their tick; stock ones are grouped by the second they ran in."""
    counts: dict[int, int] = {}
    for send in sends:
        tick = send.get("tick")
        second = int(time.mktime(time.strptime(tick[:19], "%Y-%m-%dT%H:%M:%S"))) if tick else int(send["t"] + 0.5)
        counts[second] = counts.get(second, 0) + 1
    return counts


def two_replicas(scheduler: str, seconds: float, url: str) -> tuple[int, int]:
    """(sends, duplicates) of two replicas running together for ``seconds``."""
    s = Scenario("redis", broker_url("redis"), ["q"])
    try:
        s.worker(app=APP, conf={"durable_database_url": url}, queues=["q"], concurrency=4).wait_ready()
        entries = {f"two-{scheduler[:5]}": {"every": 1}}
        replicas = [s.beat(conf={"durable_database_url": url}, entries=entries, scheduler=scheduler).wait_started()
                    for _ in range(2)]
        _run_for(seconds)
        for replica in replicas:
            replica.terminate()
        sends = _settle(s)
        return len(sends), sum(n - 1 for n in _per_tick(sends).values() if n > 1)
    finally:
        s.cleanup()


def restarted(scheduler: str, seconds: float, gap: float, url: str) -> tuple[int, int]:
    """(sends, ticks lost) of one replica run, stopped for ``gap`` seconds, and run again."""
    s = Scenario("redis", broker_url("redis"), ["q"])
    try:
        s.worker(app=APP, conf={"durable_database_url": url}, queues=["q"], concurrency=4).wait_ready()
        entries = {f"restart-{scheduler[:5]}": {"every": 1, "catch_up": "all"}}
        conf = {"durable_database_url": url, "durable_beat_lease_ttl": 3}
        first = s.beat(conf=conf, entries=entries, scheduler=scheduler).wait_started()
        _run_for(seconds / 2)
        first.terminate()
        _run_for(gap)
        # Stock beat keeps its state in its schedule file: the restart reads the first run's.
        again = s.beat(conf=conf, entries=entries, scheduler=scheduler,
                       extra_args=["-s", str(first.log_path.with_suffix(".schedule"))] if scheduler == STOCK else [])
        again.wait_started()
        _run_for(seconds / 2)
        again.terminate()
        sends = _settle(s)
        ticks = sorted(_per_tick(sends))
        window = ticks[-1] - ticks[0] + 1
        return len(sends), window - len(ticks)
    finally:
        s.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--gap", type=float, default=10.0)
    parser.add_argument("--write", type=Path)
    options = parser.parse_args()
    os.environ.setdefault("E2E_LOG_DIR", tempfile.mkdtemp(prefix="beat-scenario-"))
    rows = []
    with fresh_store("postgresql", Path(tempfile.mkdtemp())) as url:
        ensure_schema(url)
        for name, scheduler in (("stock beat", STOCK), ("celery_durable.Scheduler", DURABLE)):
            sends, duplicates = two_replicas(scheduler, options.seconds, url)
            sent_after_restart, lost = restarted(scheduler, options.seconds, options.gap, url)
            rows.append(f"| {name} | {sends} sends, **{duplicates} duplicates** | "
                        f"{sent_after_restart} sends, **{lost} ticks lost** |")
    dispose_all()
    report = "\n".join([
        "# Beat: two replicas, and a restart", "",
        f"`benchmarks/beat_scenario.py --seconds {options.seconds:g} --gap {options.gap:g}` on "
        f"{time.strftime('%Y-%m-%d')}; one entry every second, Redis broker, PostgreSQL store.", "",
        f"| scheduler | two replicas for {options.seconds:g} s | one replica, stopped {options.gap:g} s "
        f"and started again |",
        "|---|---|---|",
        *rows, "",
    ])
    print(report)
    if options.write:
        options.write.write_text(report)


if __name__ == "__main__":
    main()
