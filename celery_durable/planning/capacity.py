"""The capacity rule: the runs a worker can hold, and the pool a worker started without -c gets.

One rule for both: the claimer never holds more than ``capacity`` and boot
sizes an unsized pool by the same function, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence


def capacity(max_in_flight: int | None, pool_size: int, slots: Sequence[int]) -> int:
    """Runs the worker can hold: min(process cap, pool size, sum of queue slots)."""
    bounds = [pool_size, sum(slots)]
    if max_in_flight is not None:
        bounds.append(max_in_flight)
    return min(bounds)


def unsized_pool(max_in_flight: int | None, default_pool: int, slots: Sequence[int]) -> int:
    """The pool a worker started with no ``-c`` gets: its capacity, with the process cap (when one is set)
    in place of Celery's default pool size (the CPU count), so the pool is sized to what the worker may hold."""
    return capacity(max_in_flight, default_pool if max_in_flight is None else max_in_flight, slots)


def cap_above_pool(max_in_flight: int | None, pool_size: int) -> bool:
    """A process cap the pool cannot reach: the pool bounds the capacity instead (worth a warning at boot)."""
    return max_in_flight is not None and max_in_flight > pool_size
