"""An app configured as a Django project's is: ``config_from_object(settings, namespace="CELERY")``.

Django's settings are module attributes named ``CELERY_*``; here a plain object
stands in for ``django.conf:settings``. E2E_CONF (JSON) gives its extra
attributes, named as a Django settings module names them (``CELERY_DURABLE_...``).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from celery import Celery

import celery_durable
from tests.e2e.e2eapp import observe

_queues = os.environ.get("E2E_QUEUES", "celery").split(",")
settings = SimpleNamespace(
    CELERY_BROKER_URL=os.environ.get("E2E_BROKER", "memory://"),
    CELERY_TASK_DEFAULT_QUEUE=_queues[0],
    CELERY_WORKER_HIJACK_ROOT_LOGGER=True,
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP=True,
    **json.loads(os.environ.get("E2E_CONF", "{}")),
)

app = Celery("django-e2e")
app.config_from_object(settings, namespace="CELERY")
celery_durable.install(app)


@app.task(name="e2e.record", bind=True)
def record(self, label: str, seconds: float = 0.0) -> str:
    observe("start", label, id=self.request.id)
    observe("end", label, id=self.request.id)
    return label
