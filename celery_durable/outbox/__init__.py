"""The transactional outbox: ``enqueue`` in the caller's transaction, a relay that publishes after commit."""

from __future__ import annotations

from celery_durable.outbox.enqueue import enqueue
from celery_durable.outbox.transaction import transaction

__all__ = ["enqueue", "transaction"]
