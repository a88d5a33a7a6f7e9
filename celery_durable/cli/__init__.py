"""``celery durable``: the operator commands (the ``celery.commands`` entry point names ``durable`` here).

Importing this package registers ``-P durable`` (see ``group``) and every
command on the group: the store's (``store``), the runs' (``runs``), the
durable beat's schedule (``schedule``, ``schedule_edit``), the fleet on one screen (``status``), one
live page (``dashboard``) and the move onto the broker that claims rows (``broker``).
"""

from __future__ import annotations

from celery_durable.cli import broker as _broker  # noqa: F401 - registers its commands
from celery_durable.cli import dashboard as _dashboard  # noqa: F401
from celery_durable.cli import runs as _runs  # noqa: F401
from celery_durable.cli import schedule as _schedule  # noqa: F401
from celery_durable.cli import schedule_edit as _schedule_edit  # noqa: F401
from celery_durable.cli import status as _status  # noqa: F401
from celery_durable.cli import store as _store  # noqa: F401
from celery_durable.cli.group import durable, store_url_of

__all__ = ["durable", "store_url_of"]
