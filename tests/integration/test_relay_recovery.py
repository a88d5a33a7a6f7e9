"""The outbox relay after an outage of its store or broker: it wakes as soon as they are back.

Each outage is the test's own FaultProxy's, in front of the relay only; the shared services
stay up. The outage is held until the relay has failed enough passes in a row that its backoff
has doubled to many seconds, and ends right after the latest failure: at the start of that long
backoff, the worst moment for a relay that sleeps its backoff out.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timezone

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_durable import outbox
from celery_durable.outbox.relay import Relay
from tests.e2e.harness import wait_for
from tests.faultproxy import FaultProxy
from tests.integration.test_outbox import drain_ids, make_app, outbox_row
from tests.services import broker_url

ProxyFactory = Callable[[str], FaultProxy]

#: Failed passes in a row before the store comes back: the backoff after the 6th is 16 s (±20%).
#: A failing store pass fails at once (refused), so this is an outage of about 16 s.
STORE_FAILURES = 6
#: The same for the broker: 8 s after the 5th. A failing broker pass takes seconds itself (kombu
#: retries the connection inside it), so this is an outage of 20-40 s.
BROKER_FAILURES = 5
#: Seconds from a commit right after the restore to its publish: one probe interval (1 s) and a
#: pass, or a missed notification and one poll (1 s); the rest is slack for a loaded machine.
PROMPT = 3.0


@contextmanager
def running(relay: Relay) -> Iterator[Relay]:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


def enqueue(app: Celery, engine: sa.engine.Engine, queue: str, label: str) -> tuple[str, float]:
    """Commit one row; its task id and the wall-clock time just after the commit."""
    with engine.begin() as conn:
        task_id = outbox.enqueue(conn, app.tasks["outbox.noop"].s(label), queue=queue).id
    return task_id, time.time()


def publish_latency(store_url: str, task_id: str, committed: float) -> float:
    row = wait_for(lambda: (r := outbox_row(store_url, task_id)) and r["published_at"] and r,
                   timeout=90, what=f"row {task_id} to publish", every=0.01)
    return float(row["published_at"].astimezone(timezone.utc).timestamp() - committed)


@pytest.mark.long
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_the_relay_publishes_promptly_once_its_store_is_back(
        store_url: str, user_engine: sa.engine.Engine, fault_proxy: ProxyFactory) -> None:
    app = make_app(broker_url("redis"), store_url)
    queue = f"store-back-{uuid.uuid4().hex[:8]}"
    proxy = fault_proxy(store_url)
    # Only the relay reaches the store through the proxy; the caller commits directly.
    with running(Relay(app, url=proxy.url_for(store_url))) as relay:
        first, committed = enqueue(app, user_engine, queue, "before")
        publish_latency(store_url, first, committed)
        proxy.outage()
        wait_for(lambda: relay.failures >= STORE_FAILURES, timeout=60, every=0.005,
                 what=f"{STORE_FAILURES} relay passes in a row to fail on the store")
        proxy.restore()
        task_id, committed = enqueue(app, user_engine, queue, "after")
        latency = publish_latency(store_url, task_id, committed)
        # (Not asserting that a probe ended the backoff: a backoff may also happen to end
        # right after the restore, before the next probe. The latency is the contract.)
        print(f"store back: a row committed right after was published in {latency:.2f} s "
              f"(backoffs ended by a probe: {getattr(relay, 'recoveries', 'n/a')})")
        assert latency < PROMPT, f"published {latency:.1f} s after the store came back"
    assert sorted(drain_ids(app, queue)) == sorted([first, task_id])


@pytest.mark.long
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_the_relay_publishes_promptly_once_its_broker_is_back(
        store_url: str, user_engine: sa.engine.Engine, broker_kind: str, fault_proxy: ProxyFactory) -> None:
    real_broker = broker_url(broker_kind)
    proxy = fault_proxy(real_broker)
    app = make_app(proxy.url_for(real_broker), store_url)
    queue = f"broker-back-{uuid.uuid4().hex[:8]}"
    with running(Relay(app)) as relay:
        first, committed = enqueue(app, user_engine, queue, "before")
        publish_latency(store_url, first, committed)
        proxy.outage()
        during, _ = enqueue(app, user_engine, queue, "during")
        wait_for(lambda: relay.failures >= BROKER_FAILURES, timeout=90, every=0.005,
                 what=f"{BROKER_FAILURES} relay passes in a row to fail on the broker")
        failed = outbox_row(store_url, during)
        assert failed is not None and failed["published_at"] is None and failed["attempts"] >= 1
        deferred = failed["available_at"].timestamp() - time.time()
        proxy.restore()
        restored = time.time()
        after, committed = enqueue(app, user_engine, queue, "after")
        latency = publish_latency(store_url, after, committed)
        during_latency = publish_latency(store_url, during, restored)
        print(f"{broker_kind} back: a row committed right after was published in {latency:.2f} s, "
              f"the row that failed through the outage ({failed['attempts']} attempts, deferred "
              f"{deferred:.1f} s past the restore) {during_latency:.2f} s after the restore "
              f"(backoffs ended by a probe: {getattr(relay, 'recoveries', 'n/a')})")
        assert latency < PROMPT, f"published {latency:.1f} s after the broker came back"
        assert during_latency < PROMPT, f"the row deferred by the outage waited {during_latency:.1f} s"
        # Its attempts are history, kept (a row flagged during an outage stays flagged).
        assert outbox_row(store_url, during)["attempts"] == failed["attempts"]
    assert sorted(drain_ids(app, queue)) == sorted([first, during, after])
