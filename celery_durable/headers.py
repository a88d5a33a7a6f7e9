"""Every wire name celery_durable writes or reads: message headers, broker key and queue names, NOTIFY channels.

Pure constants, importable from every layer. A name here is on the wire: a
worker of the next release reads what this one wrote, so change a value only
with a migration path. ``tests/unit/test_headers.py`` pins each value and
checks no other module spells one out.
"""

from __future__ import annotations

# -- headers a durable run's messages carry between its deliveries --------------------------------
#: The lease token a run was handed to (a wake-up, a re-send after a store outage): that delivery
#: may take the run over at once, and does not count as a lost attempt.
RESUME_HEADER = "durable_resume"
#: How many times a delivery already waited for the store.
STORE_WAITS_HEADER = "durable_store_waits"
#: The Unix time a task message was sent (stamped on every send by an app with celery_durable
#: installed, ``tasks/sent_stamp.py``): the queue gauges read the oldest ready age from it.
SENT_AT_HEADER = "durable_sent_at"

# -- headers a caller may set (``apply_async(headers={...})``) --------------------------------------
#: The fleet-limit key of this one call (``headers={"durable_key": "org:7"}``); the same name as the
#: task option it overrides.
KEY_HEADER = "durable_key"
#: What this one call does when its limit is busy (``headers={"durable_when_busy": "drop"}``).
WHEN_BUSY_HEADER = "durable_when_busy"

# -- headers a parked (poison) message carries on RabbitMQ -------------------------------------------
PARKED_FROM_HEADER = "x-durable-parked-from"
PARKED_REASON_HEADER = "x-durable-parked-reason"

# -- Celery's own task-message headers (protocol 2) that celery_durable reads --------------------------
TASK_NAME_HEADER = "task"
TASK_ID_HEADER = "id"
ETA_HEADER = "eta"
TASK_RETRIES_HEADER = "retries"

# -- broker names beside a queue or kombu's unacked hash ---------------------------------------------
#: ``<queue>.durable.parked``: where a queue's poison messages go (a Redis list or a broker queue).
PARKED_SUFFIX = ".durable.parked"
#: ``<unacked>.durable_holders``: a Redis sorted set of holder tokens by heartbeat. Kept per unacked
#: hash, since a holder's tags mean something only in the hash they were recorded in.
HOLDERS_SUFFIX = ".durable_holders"
#: ``<unacked>.durable_held.<holder>``: the tags one holder claimed.
HELD_SUFFIX = ".durable_held."

# -- PostgreSQL NOTIFY channels -----------------------------------------------------------------------
#: A commit with outbox rows notifies it; the relay LISTENs on it.
OUTBOX_CHANNEL = "durable_outbox"
#: A transaction that made a waiting (fleet-limited) message ready notifies it.
LIMITS_CHANNEL = "durable_limits"
#: The PostgreSQL broker's insert trigger (migration 0009) notifies it, with the queue name as payload.
BROKER_CHANNEL = "durable_broker"

# -- HTTP ------------------------------------------------------------------------------------------------
#: The dashboard's action token (``durable_dashboard_token``), on each POST.
DASHBOARD_TOKEN_HEADER = "X-Durable-Token"
