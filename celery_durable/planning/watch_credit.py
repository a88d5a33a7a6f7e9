"""When the RabbitMQ queue watch may give its one credit again: the pure rule.

The watch (worker/queue_watch.py) lets the broker push at most one message not yet started, and
only once a claim pass with room gave it the credit. A credit a message took comes back when the
placeholder is delivered again; giving it again at once, on every pass of a busy worker, would
cost a cancel and a reject per pass and let the broker push a message per pass that a full worker
then gives back. ``WATCH_CREDIT_EVERY`` bounds that churn: a message landing on a watched queue
waits at most that long (plus a pass) longer than it would with the credit always given.
"""

from __future__ import annotations

#: Seconds between two gives of the watch's credit. Stock Celery's own wait for a message landing on
#: a quiet queue while its prefetch is full is 12-20 ms p50 for no-op tasks (planning/known_ready.py):
#: 5 ms keeps the watch well inside it at one cancel and one reject per 5 ms at most.
WATCH_CREDIT_EVERY = 0.005


def may_give_credit(last_given_at: float | None, now: float) -> bool:
    """Whether a pass may give the credit at ``now`` (monotonic), last given at ``last_given_at`` (None: never).

    A clock that went backwards (a fake one, or a suspended VM's) gives it: waiting would
    only hold a message back for no reason.
    """
    return last_given_at is None or not 0 <= now - last_given_at < WATCH_CREDIT_EVERY
