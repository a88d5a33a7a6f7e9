"""The soak of issue 8: 500 durable runs under SIGKILLs, a store outage and a broker outage all settle, none lost.

Deselected by default (``addopts = "-m 'not soak'"``); run it with
``CI=true pytest -m soak tests/soak -s`` (``-s`` shows the figures). ``SOAK_RUNS``
and ``SOAK_SEED`` change the number of runs and the seed of their step times.

Three ``-P durable`` workers (prefork and threads) reach the broker and the store
through two FaultProxy instances the test owns; the test itself sends, observes and
reads the store directly. Each run (``durable.soak``) is a plain step, a
transactional step and a plain step; the plain steps record their effect in the
observer with the pid that ran them, so a step run twice can be traced to the
process killed inside it.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from celery_durable.store.engine import engine_for
from celery_durable.store.schema import SETTLED
from tests.e2e.durable_support import (  # noqa: F401 - durable_scenario is a fixture
    APP,
    conf,
    durable_scenario,
)
from tests.e2e.harness import Scenario, WorkerProcess, wait_for

RUNS = int(os.environ.get("SOAK_RUNS", "500"))
SEED = int(os.environ.get("SOAK_SEED", "8"))
LEASE_TTL = 3
CONCURRENCY = 4
STORE_OUTAGE = 20.0
BROKER_OUTAGE = 10.0
KILLS = 5
#: Fewest runs that must still be unsettled when a fault lands: a fault after the work is done proves nothing.
IN_FLIGHT_AT_FAULT = 20
SETTLE_DEADLINE = 600.0
#: Seconds every live worker has, once an outage ends, to start a step again (with a backlog waiting).
RESUME_DEADLINE = 30.0
PLAIN_STEPS = ("first", "last")
#: Log lines counted in every worker's log (killed ones included).
LOG_EVENTS = ("durable.run.deferred", "durable.run.store_wait", "durable.run.store_wait_failed",
              "durable.run.duplicate", "durable.lease.lost", "durable.run.lease_lost", "durable.run.settled_before",
              "durable.store.unavailable", "durable.store.available", "durable.run.exhausted")


def step_times(rng: random.Random) -> tuple[float, float]:
    """Most runs short; a quarter with steps around and past the lease TTL (renewed while they run)."""
    if rng.random() < 0.75:
        return round(rng.uniform(0.5, 1.2), 2), round(rng.uniform(0.5, 1.2), 2)
    return round(rng.uniform(2.0, 4.0), 2), round(rng.uniform(2.0, 4.0), 2)


@dataclass
class Kill:
    at: float
    worker_pid: int
    execution: str
    children: list[int]
    unsettled: int
    #: Wall time of the SIGKILL (the workers stamp their events with the same host's clock).
    wall: float


@dataclass
class Fleet:
    """The soak's workers: kept to the end (the killed ones for their logs), replaced as they are killed."""

    s: Scenario
    settings: dict[str, Any]
    broker_url: str
    live: list[tuple[WorkerProcess, str]] = field(default_factory=list)
    dead: list[tuple[WorkerProcess, str]] = field(default_factory=list)

    def start(self, execution: str) -> WorkerProcess:
        worker = self.s.worker(app=APP, conf={**self.settings, "durable_execution": execution},
                               concurrency=CONCURRENCY, broker_url=self.broker_url)
        self.live.append((worker, execution))
        return worker

    def kill_one(self, rng: random.Random, unsettled: int, started: float) -> Kill:
        worker, execution = self.live.pop(rng.randrange(len(self.live)))
        pid = worker.process.pid
        # Recorded before the kill: a duplicate effect is explained only by a pid in this list.
        children = children_of(pid)
        assert worker.process.poll() is None, f"worker {pid} died before it was killed:\n{worker.log()[-3000:]}"
        worker.kill()
        wall = time.time()
        self.dead.append((worker, execution))
        self.start(execution).wait_ready(timeout=120)
        return Kill(round(time.monotonic() - started, 1), pid, execution, children, unsettled, wall)

    def idle_since(self, since: float, within: float) -> list[tuple[int, str]]:
        """The live workers (pid, execution) that start no step between ``since`` and ``within`` s later."""
        waiting = {worker.process.pid: execution for worker, execution in self.live}
        deadline = time.monotonic() + within
        while waiting and time.monotonic() < deadline:
            recent = {int(e["pid"]) for e in self.s.labelled("effect", "soak-") if e["t"] > since}
            for pid in list(waiting):
                if recent & {pid, *children_of(pid)}:
                    del waiting[pid]
            time.sleep(0.5)
        return sorted(waiting.items())

    def all(self) -> list[tuple[WorkerProcess, str]]:
        return self.live + self.dead


def states(url: str) -> Counter[str]:
    with engine_for(url).connect() as conn:
        return Counter({state: int(n) for state, n in
                        conn.execute(sa.text("SELECT state, count(*) FROM durable_runs GROUP BY state"))})


def unsettled(url: str) -> int:
    by_state = states(url)
    return RUNS - sum(by_state.get(state, 0) for state in SETTLED)


def children_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in found.stdout.split()]


def hold(seconds: float) -> None:
    time.sleep(seconds)  # holds an outage open, or spaces two faults: nothing to poll for


@pytest.mark.soak
@pytest.mark.timeout(SETTLE_DEADLINE + 900)
@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq", "postgresql"])
def test_soak_every_run_settles_once_through_kills_and_outages(durable_scenario, fault_proxy, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    store_proxy = fault_proxy(url)
    if broker_kind == "postgresql":
        # The broker that claims rows is the store's database: one proxy, so each outage is of both.
        broker_proxy = store_proxy
        workers_broker = f"durable+{store_proxy.url_for(url)}"
    else:
        broker_proxy = fault_proxy(s.broker_url)
        workers_broker = broker_proxy.url_for(s.broker_url)
    # kombu's visibility timeout is left at its default (an hour): a killed worker's runs come back by
    # liveness (Redis: its heartbeat stops; RabbitMQ: its connection; the rows broker: the row's lease),
    # within 2 x the lease TTL.
    settings = conf(store_proxy.url_for(url), durable_lease_ttl=LEASE_TTL, durable_relay=False,
                    durable_restore_interval=1.0)
    fleet = Fleet(s, settings, workers_broker)
    for execution in ("prefork", "threads", "prefork"):
        fleet.start(execution)
    for worker, _ in fleet.live:
        worker.wait_ready(timeout=120)

    rng = random.Random(SEED)
    plan = {f"soak-{n}": step_times(rng) for n in range(RUNS)}
    started = time.monotonic()
    ids = {label: s.send_task("q", "durable.soak", [label, first, last]) for label, (first, last) in plan.items()}
    label_of = {run_id: label for label, run_id in ids.items()}
    sent = time.monotonic() - started

    # -- the fault schedule, while the runs are in flight --------------------------------------------
    faults: list[str] = []
    kills: list[Kill] = []

    def in_flight(what: str) -> int:
        left = unsettled(url)
        assert left >= IN_FLIGHT_AT_FAULT, f"{what} would land with only {left} runs unsettled"
        return left

    def kill() -> None:
        left = in_flight(f"kill {len(kills) + 1}")
        kills.append(fleet.kill_one(rng, left, started))
        faults.append(f"t={kills[-1].at:6.1f}s SIGKILL {kills[-1].execution} worker {kills[-1].worker_pid} "
                      f"(children {kills[-1].children}), {left} unsettled")

    stalled: list[str] = []

    def outage(name: str, proxy: Any, seconds: float, then: float) -> None:
        left = in_flight(f"the {name} outage")
        at = time.monotonic() - started
        proxy.outage()
        hold(seconds)
        proxy.restore()
        back = time.time()
        faults.append(f"t={at:6.1f}s {name} outage {seconds:.0f}s, {left} unsettled")
        # Every worker takes work again once the service is back (a worker that stops claiming
        # loses nothing while others carry its load: only this sees it).
        idle = fleet.idle_since(back, within=RESUME_DEADLINE)
        stalled.extend(f"{execution} worker {pid} started no step within {RESUME_DEADLINE:.0f}s after the "
                       f"{name} outage" for pid, execution in idle)
        hold(max(0.0, then - (time.time() - back)))

    # The first kill once every worker is inside steps.
    wait_for(lambda: len(s.labelled("effect", "soak-")) >= 3 * CONCURRENCY, timeout=120,
             what="every worker to be inside steps")
    kill()
    hold(8)
    outage("store", store_proxy, STORE_OUTAGE, then=12)
    kill()
    hold(10)
    outage("broker", broker_proxy, BROKER_OUTAGE, then=10)
    for _ in range(KILLS - 2):
        kill()
        hold(10)
    faults_done = time.monotonic() - started

    # -- every run settles ------------------------------------------------------------------------------
    try:
        wait_for(lambda: unsettled(url) == 0, timeout=SETTLE_DEADLINE, what=f"all {RUNS} runs to settle", every=1.0)
    finally:
        wall = time.monotonic() - started
        figures = collect(s, url, fleet, ids, label_of, kills)
        figures["stalled"] = stalled
        print_figures(broker_kind, figures, faults, sent, faults_done, wall)

    # -- what they did ----------------------------------------------------------------------------------
    assert figures["states"] == {"succeeded": RUNS}, figures["states"]
    assert stalled == [], f"workers that stopped taking work: {stalled}"
    assert figures["ledger_not_once"] == {}, f"transactional step not exactly once: {figures['ledger_not_once']}"
    assert figures["missing_effects"] == [], f"plain steps never run: {figures['missing_effects'][:20]}"
    assert figures["violations"] == [], f"duplicates no kill explains: {figures['violations'][:20]}"
    for worker, execution in fleet.live:
        assert worker.process.poll() is None, f"a {execution} worker died unkilled:\n{worker.log()[-3000:]}"
    assert figures["child_deaths"] == [], f"pool children died unkilled: {figures['child_deaths']}"
    assert figures["vanished"] == [], f"processes that ran steps died unkilled: {figures['vanished']}"
    slowest = max((seconds for per_kill in figures["recovery"].values() for _, seconds in per_kill), default=0.0)
    assert slowest <= 2 * LEASE_TTL, f"a killed worker's run took {slowest:.2f}s to run again: {figures['recovery']}"
    for worker, _ in list(fleet.live):
        assert worker.terminate() == 0


def collect(s: Scenario, url: str, fleet: Fleet, ids: dict[str, str], label_of: dict[str, str],
            kills: list[Kill]) -> dict[str, Any]:
    """Everything the figures and the assertions read: the store, the observer, the logs."""
    with engine_for(url).connect() as conn:
        rows = conn.execute(sa.text("SELECT id, state, attempts, lost_attempts FROM durable_runs")).all()
        ledger = {r: int(n) for r, n in conn.execute(sa.text(
            "SELECT run_id, count(*) FROM e2e_effects WHERE step = 'ledger' GROUP BY run_id"))}
    by_id = {row.id: row for row in rows}
    states_ = Counter(row.state for row in rows)
    never_stored = [run_id for run_id in ids.values() if run_id not in by_id]
    if never_stored:
        states_["(no row)"] = len(never_stored)

    killed = {k.worker_pid for k in kills} | {c for k in kills for c in k.children}
    alive = {worker.process.pid for worker, _ in fleet.live if worker.process.poll() is None}
    alive |= {child for pid in list(alive) for child in children_of(pid)}
    effect_pids: dict[tuple[str, str], list[int]] = defaultdict(list)
    for event in s.labelled("effect", "soak-"):
        effect_pids[(event["label"], event["step"])].append(int(event["pid"]))
    missing: list[tuple[str, str]] = []
    explained: list[tuple[str, str, str, list[int]]] = []
    violations: list[tuple[str, str, str, list[int]]] = []
    for label, run_id in ids.items():
        for step in PLAIN_STEPS:
            pids = effect_pids.get((label, step), [])
            if not pids:
                missing.append((label, step))
                continue
            extra = len(pids) - 1
            if extra:
                by_killed = sum(1 for pid in pids if pid in killed)
                entry = (label, run_id, step, pids)
                (explained if by_killed >= extra else violations).append(entry)
    # Every process that ran a step was killed by the test or is still alive: none died on its own.
    vanished = sorted({pid for pids in effect_pids.values() for pid in pids} - killed - alive)
    # A kill's "mid-step" count: effects by its pids whose step had to run again.
    killed_mid_step: Counter[int] = Counter()
    for kill in kills:
        by_kill = {kill.worker_pid, *kill.children}
        killed_mid_step[kill.worker_pid] = sum(1 for *_, ran_by in explained if by_kill & set(ran_by))

    logs: dict[str, Counter[str]] = {}
    child_deaths: list[str] = []
    for worker, execution in fleet.all():
        text = worker.log()
        logs[f"{worker.process.pid} {execution}{' (killed)' if (worker, execution) in fleet.dead else ''}"] = \
            Counter({e: len(re.findall(rf"\b{re.escape(e)}\b", text)) for e in LOG_EVENTS})
        child_deaths += [line for line in text.splitlines()
                         if "WorkerLostError" in line or re.search(r"Process .* exited with", line)]
    totals: Counter[str] = Counter()
    for counts in logs.values():
        totals.update(counts)
    return {
        "recovery": recovery_times(s, kills),
        "states": dict(states_),
        "never_stored": never_stored,
        "attempts": Counter(row.attempts for row in rows),
        "lost_attempts": Counter(row.lost_attempts for row in rows),
        "max_lost": max((row.lost_attempts for row in rows), default=0),
        "sum_lost": sum(row.lost_attempts for row in rows),
        "ledger_not_once": {label_of.get(r, r): ledger.get(r, 0) for r in ids.values() if ledger.get(r, 0) != 1},
        "effects": sum(len(p) for p in effect_pids.values()),
        "missing_effects": missing,
        "explained": explained,
        "violations": violations,
        "killed_mid_step": killed_mid_step,
        "logs": logs,
        "log_totals": totals,
        "child_deaths": child_deaths,
        "vanished": vanished,
    }


def recovery_times(s: Scenario, kills: list[Kill]) -> dict[int, list[tuple[str, float]]]:
    """Per kill (worker pid): each run a killed process was inside a step of, and the seconds from the
    SIGKILL to that run's next step starting in another process."""
    effects = s.labelled("effect", "soak-")
    out: dict[int, list[tuple[str, float]]] = {}
    for kill in kills:
        pids = {kill.worker_pid, *kill.children}
        # A run was inside the killed worker if its last step before the kill was started there.
        last_before: dict[str, dict[str, Any]] = {}
        for e in effects:
            if e["t"] < kill.wall and (e["label"] not in last_before or e["t"] > last_before[e["label"]]["t"]):
                last_before[e["label"]] = e
        inside = {label for label, e in last_before.items() if int(e["pid"]) in pids}
        times = []
        for label in sorted(inside):
            later = [e["t"] for e in effects if e["label"] == label and e["t"] >= kill.wall]
            if later:  # no later step: the run had ended before the kill
                times.append((label, round(min(later) - kill.wall, 2)))
        out[kill.worker_pid] = times
    return out


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"p50 {ordered[len(ordered) // 2]:.2f}s, max {ordered[-1]:.2f}s"


def print_figures(broker_kind: str, f: dict[str, Any], faults: list[str], sent: float, faults_done: float,
                  wall: float) -> None:
    out = [
        "",
        (f"==== soak figures: {broker_kind}, PostgreSQL; {RUNS} runs x 3 steps, seed {SEED}, "
         f"visibility timeout kombu's default, lease ttl {LEASE_TTL}s, 3 workers -c{CONCURRENCY} ===="),
        f"wall time: {wall:.1f}s (sent in {sent:.1f}s, faults over at {faults_done:.1f}s)",
        "faults:", *[f"  {line}" for line in faults],
        f"settled by state: {f['states']}",
        f"attempts per run: {dict(sorted(f['attempts'].items()))}",
        (f"lost attempts per run: {dict(sorted(f['lost_attempts'].items()))} "
         f"(sum {f['sum_lost']}, max {f['max_lost']})"),
        f"transactional rows != 1: {len(f['ledger_not_once'])} {dict(list(f['ledger_not_once'].items())[:10])}",
        f"plain-step effects: {f['effects']} for {2 * RUNS} steps; never run: {len(f['missing_effects'])}",
        (f"duplicates explained by a killed pid: {len(f['explained'])}; "
         f"per kill (worker pid: steps run again): {dict(f['killed_mid_step'])}"),
        *[f"  {label} {step} pids {pids}" for label, _, step, pids in f["explained"]],
        f"duplicates NOT explained (violations): {len(f['violations'])}",
        (f"recovery (kill -> the next step of each run the killed worker was inside, run elsewhere; "
         f"bound 2 x TTL = {2 * LEASE_TTL}s):"),
        *[f"  {label} {run_id} {step} pids {pids}" for label, run_id, step, pids in f["violations"]],
        *[f"  kill {pid}: {len(runs)} runs in a step ran again after {_spread([t for _, t in runs])}"
          for pid, runs in f["recovery"].items()],
        f"log events (all workers): {dict(f['log_totals'])}",
        *[f"  {name}: {dict(+counts)}" for name, counts in f["logs"].items()],
        (f"pool children lost (log lines): {len(f['child_deaths'])}; step-running pids gone unkilled: "
         f"{f['vanished']}"),
        *[f"  {line}" for line in f["child_deaths"][:10]],
        "====",
    ]
    print("\n".join(out), flush=True)
