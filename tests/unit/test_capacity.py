"""The capacity rule, from tables: what a worker can hold, and the pool a worker with no -c gets."""

from __future__ import annotations

import pytest

from celery_durable.planning.capacity import cap_above_pool, capacity, unsized_pool


@pytest.mark.parametrize(
    "max_in_flight, pool_size, slots, expected",
    [
        pytest.param(None, 4, [8, 8], 4, id="no-cap-pool-bounds"),
        pytest.param(None, 32, [8, 2], 10, id="no-cap-slots-bound"),
        pytest.param(3, 8, [8, 8], 3, id="cap-bounds"),
        pytest.param(16, 8, [8, 8], 8, id="cap-above-pool"),
        pytest.param(16, 32, [2, 3], 5, id="cap-above-slots"),
        pytest.param(1, 1, [1], 1, id="all-one"),
        pytest.param(5, 8, [], 0, id="no-queues"),
    ],
)
def test_capacity(max_in_flight, pool_size, slots, expected):
    assert capacity(max_in_flight, pool_size, slots) == expected


@pytest.mark.parametrize(
    "max_in_flight, cpus, slots, expected",
    [
        pytest.param(16, 4, [8, 8], 16, id="cap-set-sizes-the-pool-past-the-cpus"),
        pytest.param(16, 4, [8, 2], 10, id="cap-set-slots-bound"),
        pytest.param(2, 8, [8, 8], 2, id="cap-set-below-the-cpus"),
        pytest.param(None, 4, [8, 8], 4, id="no-cap-cpus-bound"),
        pytest.param(None, 32, [8, 2], 10, id="no-cap-slots-bound"),
        pytest.param(None, 4, [], 0, id="no-queues"),
    ],
)
def test_unsized_pool(max_in_flight, cpus, slots, expected):
    assert unsized_pool(max_in_flight, cpus, slots) == expected


@pytest.mark.parametrize("max_in_flight, cpus, slots", [(16, 4, [8, 8]), (None, 4, [8, 8]), (3, 8, [1, 1]),
                                                         (None, 2, [8])])
def test_an_unsized_pool_holds_exactly_the_capacity_it_gives(max_in_flight, cpus, slots):
    # Sized by the rule, the pool never bounds the capacity below what the cap and slots allow,
    # and the capacity is the pool: no claimed run waits for a process.
    pool = unsized_pool(max_in_flight, cpus, slots)
    assert capacity(max_in_flight, pool, slots) == pool


@pytest.mark.parametrize("max_in_flight, pool, expected", [(None, 4, False), (4, 4, False), (5, 4, True),
                                                           (1, 4, False)])
def test_cap_above_pool(max_in_flight, pool, expected):
    assert cap_above_pool(max_in_flight, pool) is expected
