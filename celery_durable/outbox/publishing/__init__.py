"""Getting claimed outbox rows onto the broker: each row's task message, and a whole batch per transport."""

from __future__ import annotations

from celery_durable.outbox.publishing.batch import publish_batch
from celery_durable.outbox.publishing.outcome import BatchPublished
from celery_durable.outbox.publishing.task_message import Captured, RowSender

__all__ = ["BatchPublished", "Captured", "RowSender", "publish_batch"]
