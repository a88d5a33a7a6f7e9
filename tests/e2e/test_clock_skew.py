"""One worker's wall clock 60 s off (that process alone): leases keep one clock, the store's.

Written and compared with each worker's own clock, a worker 60 s ahead saw every other worker's fleet-limit
leases as expired (``durable_concurrency=2`` ran every slot of the fleet at once) and took over live durable
runs; one 60 s behind wrote leases that looked expired to everyone else. PostgreSQL store, Redis broker.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.durable_support import APP as DURABLE_APP
from tests.e2e.durable_support import conf, durable_scenario, effects, run_state  # noqa: F401 - fixture
from tests.e2e.harness import wait_for
from tests.services import in_ci

LIMITS_APP = "tests.e2e.limitsapp"
SHIM_SOURCE = Path(__file__).parent / "native" / "clock_shift.c"
TTL = 3.0


@pytest.fixture(scope="session")
def clock_shift_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/e2e/native/clock_shift.c built with the machine's C compiler (gcc, as on every CI machine)."""
    library = tmp_path_factory.mktemp("clock-shift") / "libclockshift.so"
    try:
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(SHIM_SOURCE), "-ldl"],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        message = f"cannot build the clock shim with gcc: {getattr(exc, 'stderr', '') or exc}"
        if in_ci():
            pytest.fail(f"{message} (under CI=true a missing tool is a failure)")
        pytest.skip(message)
    return library


@pytest.fixture
def shifted(clock_shift_library: Path) -> Callable[[float], dict[str, str]]:
    """``shifted(60)``: the environment of a process whose wall clock runs 60 s ahead (monotonic untouched)."""

    def env(seconds: float) -> dict[str, str]:
        preload = " ".join(p for p in (str(clock_shift_library), os.environ.get("LD_PRELOAD", "")) if p)
        return {"LD_PRELOAD": preload, "CLOCK_SHIFT_SECONDS": str(seconds)}

    return env


@pytest.mark.parametrize("offset", [60, -60])
def test_a_worker_with_its_clock_a_minute_off_never_exceeds_a_fleet_limit(durable_scenario, shifted, offset):
    s, url = durable_scenario("postgresql", "redis")
    settings = conf(url, durable_lease_ttl=TTL)
    limit = {"E2E_EXPORT_CONCURRENCY": "2"}
    workers = [s.worker(app=LIMITS_APP, conf=settings, concurrency=2, env={**limit, **shifted(offset)})]
    workers += [s.worker(app=LIMITS_APP, conf=settings, concurrency=2, env=limit) for _ in range(2)]
    for worker in workers:
        worker.wait_ready(60)
    ids = [s.send_task("q", "limits.export", [f"e{n}", 0.6]) for n in range(12)]
    wait_for(lambda: len(s.labelled("end", "e")) >= len(ids), timeout=60, what="every export to end")
    assert s.max_concurrency(only=lambda e: e["label"].startswith("e")) == 2
    assert sorted(e["id"] for e in s.labelled("end", "e")) == sorted(ids)
    for worker in workers:
        assert worker.terminate() == 0


@pytest.mark.parametrize("offset", [60, -60])
def test_a_worker_with_its_clock_a_minute_off_never_takes_over_a_live_run(durable_scenario, shifted, offset):
    """The live run is on the worker whose leases the other would misread: the fast worker reads a normal
    one's as expired; a normal worker reads a slow one's as expired. A copy of it goes to the other."""
    s, url = durable_scenario("postgresql", "redis")
    # A queue of its own for the copy's worker (cleaned up with the scenario's).
    s.by_name["copy"] = f"{s.by_name['q']}-copy"
    s.queues.append(s.by_name["copy"])
    settings = conf(url, durable_lease_ttl=TTL)
    skew = shifted(offset)
    holder_env, copier_env = ({}, skew) if offset > 0 else (skew, {})
    # Both workers up before the run starts: a copier still booting when the run ends would meet a finished
    # run (a duplicate), not a live one. It consumes only the copy's queue, so only the holder takes the run.
    holder = s.worker(app=DURABLE_APP, conf=settings, concurrency=1, env=holder_env)
    copier = s.worker(app=DURABLE_APP, conf=settings, concurrency=1, queues=["copy"], env=copier_env)
    holder.wait_ready(60)
    copier.wait_ready(60)
    run_id = s.send_task("q", "durable.long_steps", ["live", 3, TTL / 2])
    wait_for(lambda: s.labelled("exec", "live"), timeout=20, what="the holder to start the run")
    s.send_task("copy", "durable.long_steps", ["live", 3, TTL / 2], task_id=run_id)
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=60, what="the run to finish")
    assert len(s.labelled("exec", "live")) == 1, "a worker took over the live run"
    assert effects(url, run_id) == {"s0": 1, "s1": 1, "s2": 1}
    wait_for(lambda: "durable.run.deferred" in copier.log(), timeout=10, what="the copy to be deferred")
    for worker in (holder, copier):
        assert worker.terminate() == 0
