"""Named fault points in the step path and the outbox relay, where a crash test can stop the process.

The step context and the relay are handed a ``FaultPoints`` (``NO_FAULTS``
unless a test installed one on the app), so production pays one ``is None``
check per point and no module-global is shared between apps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The points, in the order a step reaches them.
BEFORE_FN = "step.before_fn"          # the checkpoint was not found; fn has not been called
BEFORE_COMMIT = "step.before_commit"  # fn returned (its transactional effects are pending); not committed
AFTER_COMMIT = "step.after_commit"    # the checkpoint (and a transactional fn's effects) committed
POINTS = (BEFORE_FN, BEFORE_COMMIT, AFTER_COMMIT)

#: The relay published (all or the first part of) its claimed batch; no row of it is marked yet.
RELAY_AFTER_PUBLISH = "relay.after_publish"

#: The app attribute a test's fault points ride on, into every process forked from the app's.
_APP_ATTRIBUTE = "durable_fault_points"


class FaultPoints:
    """Calls ``hook(point)`` (e.g. ``os._exit`` at one point) at each point reached; no hook, no-op."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[str], None] | None = None) -> None:
        self.hook = hook

    def reach(self, point: str) -> None:
        if self.hook is not None:
            self.hook(point)


#: What production runs with: every point a single check.
NO_FAULTS = FaultPoints()


def install(app: Any, hook: Callable[[str], None]) -> None:
    """Make the step contexts and relays of ``app`` call ``hook`` at each point (tests only).

    Installed on the app object, so a worker's pool children and its relay
    thread, all built from the app the worker imported, reach the hook.
    """
    setattr(app, _APP_ATTRIBUTE, FaultPoints(hook))


def of(app: Any) -> FaultPoints:
    """The fault points installed on ``app``; ``NO_FAULTS`` if none were."""
    points = getattr(app, _APP_ATTRIBUTE, None)
    return points if isinstance(points, FaultPoints) else NO_FAULTS
