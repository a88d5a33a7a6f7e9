"""Named fault points in the step path and the outbox relay, where a crash test can stop the process.

No-ops unless hooked.
"""

from __future__ import annotations

from collections.abc import Callable

#: The points, in the order a step reaches them.
BEFORE_FN = "step.before_fn"          # the checkpoint was not found; fn has not been called
BEFORE_COMMIT = "step.before_commit"  # fn returned (its transactional effects are pending); not committed
AFTER_COMMIT = "step.after_commit"    # the checkpoint (and a transactional fn's effects) committed
POINTS = (BEFORE_FN, BEFORE_COMMIT, AFTER_COMMIT)

#: The relay published (all or the first part of) its claimed batch; no row of it is marked yet.
RELAY_AFTER_PUBLISH = "relay.after_publish"

#: Set by a test (e.g. to ``os._exit`` at one point); None in production, so each point is one check.
hook: Callable[[str], None] | None = None


def reach(point: str) -> None:
    if hook is not None:
        hook(point)
