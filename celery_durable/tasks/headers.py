"""The message headers a durable run carries between its deliveries."""

from __future__ import annotations

#: The message header naming the lease token a run was handed to (a wake-up, a re-send after a
#: store outage): that delivery may take the run over at once, and does not count as a lost attempt.
RESUME_HEADER = "durable_resume"
#: The message header counting how many times a delivery already waited for the store.
STORE_WAITS_HEADER = "durable_store_waits"
