"""The transactional outbox: ``enqueue`` in the caller's transaction, a relay that publishes after commit."""

from __future__ import annotations

from celery_durable.outbox.enqueue import enqueue

__all__ = ["enqueue"]
