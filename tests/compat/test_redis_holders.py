"""compat.redis_holders against a real Redis: liveness, not the visibility timeout, decides what comes back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_durable.compat import redis_claim
from celery_durable.compat.redis_holders import HeldSetUnreadable, HolderScripts, held_key
from celery_durable.headers import PARKED_SUFFIX
from tests.compat.test_redis_claim import RedisQueue, redis_queue  # noqa: F401 - redis_queue is a fixture
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.redis

TTL = 1.5


@pytest.fixture
def holders_of(redis_queue: Callable[..., RedisQueue]) -> Iterator[Callable[..., tuple[RedisQueue, HolderScripts]]]:
    """``holders_of(**queue_options)``: a queue and the liveness scripts on its channel; their keys deleted after."""
    made: list[HolderScripts] = []

    def make(**options: Any) -> tuple[RedisQueue, HolderScripts]:
        q = redis_queue(**options)
        scripts = HolderScripts(q.channel)
        made.append(scripts)
        return q, scripts

    yield make
    for scripts in made:
        keys = list(scripts.client.scan_iter(match=f"{scripts.keys.unacked}.durable_*"))
        if keys:
            scripts.client.delete(*keys)


def claim_as(q: RedisQueue, holder: str, count: int) -> list[Any]:
    """Claim ``count`` messages as ``holder`` would (its held set given to the script); record them unacked."""
    asks, _ = redis_claim.claim_pass(q.channel, q.client, q.script, [q.name], PARKED_SUFFIX, [count], count,
                                     time.time(), held_key(q.channel, holder))
    messages = [q.message(item) for item in (asks[0][2] if asks else [])]
    for message in messages:
        redis_claim.record_unacked(q.channel, message)
    return messages


def queued(q: RedisQueue) -> list[str]:
    """The queue's messages in the order a claim would take them."""
    items, _, _ = q.claim(100)
    return [q.message(item).decode() for item in items]


def test_a_dead_holders_claims_come_back_in_order_ahead_of_newer_ones_and_a_live_holders_never(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of()
    for body in ("m1", "m2", "m3", "m4"):
        q.publish(body)
    scripts.beat("dead", TTL)
    scripts.beat("alive", TTL)
    held_by_dead = claim_as(q, "dead", 2)
    held_by_live = claim_as(q, "alive", 1)
    q.publish("m5")  # sent while they were held
    assert [m.decode() for m in held_by_dead + held_by_live] == ["m1", "m2", "m3"]

    # "alive" keeps beating; "dead" stops (after one last beat). Nothing is restored before a TTL has passed.
    scripts.beat("dead", TTL)
    assert scripts.dead() == []
    deadline = time.monotonic() + 10
    while not scripts.dead():
        scripts.beat("alive", TTL)
        assert time.monotonic() < deadline, "the silent holder was never found dead"
        time.sleep(0.05)  # the beat's cadence, not a synchronisation: the loop ends on dead() itself
    assert scripts.dead() == ["dead"]
    tags = scripts.held_tags_oldest_last("dead")
    assert tags == [held_by_dead[1].delivery_tag, held_by_dead[0].delivery_tag]
    scripts.restore(scripts.take_held("dead", tags))
    assert scripts.forget("dead")
    assert scripts.dead() == []
    assert q.client.exists(held_key(q.channel, "dead")) == 0

    # The dead holder's two at the head, in their order, then the rest; the live holder's stays unacked.
    assert queued(q) == ["m1", "m2", "m4", "m5"]
    assert q.client.hget(q.channel.qos.unacked_key, held_by_live[0].delivery_tag) is not None


def test_past_the_visibility_timeout_only_records_no_live_holder_holds_are_restored(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of(visibility_timeout=0)
    for body in ("live", "stock"):
        q.publish(body)
    scripts.beat("alive", TTL)
    [live] = claim_as(q, "alive", 1)
    # A stock worker's claim: in no held set (kombu's own get, as a mixed fleet has).
    items, [stock_tag], _ = q.claim(1)
    claimed_before = time.time() + 1  # every claim so far is past a visibility timeout of 0
    restorable = scripts.expired_unheld(claimed_before, -1)
    assert restorable == [stock_tag.decode()]
    scripts.restore(scripts.take_expired(restorable, claimed_before, time.time()))
    assert queued(q) == ["stock"]
    assert q.client.hget(q.channel.qos.unacked_key, live.delivery_tag) is not None


def test_a_holder_that_beats_again_before_it_is_forgotten_keeps_its_entry(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of()
    q.publish("m1")
    scripts.beat("paused", TTL)
    claim_as(q, "paused", 1)
    wait_for(lambda: scripts.dead() == ["paused"], timeout=10, what="the paused holder to be found dead",
             every=0.05)
    scripts.beat("paused", TTL)  # resumed (a SIGSTOP ended) between the scan and the forget
    assert not scripts.forget("paused")
    assert q.client.zcard(held_key(q.channel, "paused")) == 1


def test_a_beat_prunes_acked_tags_from_the_held_set_and_leave_marks_the_holder_dead_at_once(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of()
    q.publish("acked")
    q.publish("held")
    scripts.beat("w", TTL)
    acked, held = claim_as(q, "w", 2)
    acked.ack()
    assert q.client.zcard(held_key(q.channel, "w")) == 2
    scripts.beat("w", TTL)
    assert [m.decode() for m in q.client.zrange(held_key(q.channel, "w"), 0, -1)] == [held.delivery_tag]
    scripts.leave("w")
    assert scripts.dead() == ["w"]
    assert scripts.held_tags_oldest_last("w") == [held.delivery_tag]


def test_holders_live_behind_the_global_keyprefix_and_beside_their_own_unacked_hash(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    prefix = "compat-holders:"
    q, scripts = holders_of(global_keyprefix=prefix)
    scripts.beat("w", TTL)
    assert scripts.keys.holders == f"{prefix}{q.channel.qos.unacked_key}.durable_holders"
    assert q.client.zscore(scripts.keys.holders, "w") is not None


def test_each_holder_is_judged_by_its_own_ttl(holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    """A fleet mixing lease TTLs (a rolling config change, two apps on one Redis): a worker beating every 10 s
    under a 30 s TTL is alive to a judge whose own TTL is 1.5 s."""
    q, scripts = holders_of()
    scripts.beat("slow-beater", 30.0)
    scripts.beat("quick", TTL)
    wait_for(lambda: scripts.dead() == ["quick"], timeout=10, what="the quick holder's TTL to run out",
             every=0.05)
    assert "slow-beater" not in scripts.dead()


def test_a_held_key_of_another_type_is_unreadable_and_can_be_discarded(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of()
    scripts.leave("stranger")
    q.client.sadd(held_key(q.channel, "stranger"), "tag")  # not a held set: some other writer's key
    with pytest.raises(HeldSetUnreadable):
        scripts.held_tags_oldest_last("stranger")
    scripts.discard("stranger")
    assert scripts.dead() == [] and q.client.exists(held_key(q.channel, "stranger")) == 0


@pytest.mark.parametrize("prefix", ["", "compat-holders:"])
def test_a_dead_holders_tag_restored_and_claimed_again_is_not_restored_by_a_second_restorer(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]], prefix: str) -> None:
    """Every live worker scans for dead holders. Before, a second restorer on the list it read before the
    first restored (the tag unacked again: a live worker had claimed it) put a second copy in the queue:
    the CI run of 79921e6 saw a killed worker's task run twice on the survivor, 2 s apart."""
    q, scripts = holders_of(global_keyprefix=prefix)
    q.publish("m1")
    scripts.beat("dead", TTL)
    [held] = claim_as(q, "dead", 1)
    scripts.leave("dead")
    first_read = scripts.held_tags_oldest_last("dead")
    second_read = scripts.held_tags_oldest_last("dead")  # another worker's scan, at the same moment
    assert first_read == second_read == [held.delivery_tag]

    scripts.restore(scripts.take_held("dead", first_read))
    assert waiting(q, scripts) == 1
    scripts.beat("alive", TTL)
    [again] = claim_as(q, "alive", 1)  # a live worker takes it back out: unacked again, same tag
    assert again.delivery_tag == held.delivery_tag

    assert scripts.take_held("dead", second_read) == [], "the second restorer took a tag already restored"
    scripts.restore([])  # what the second restorer restores: nothing
    assert waiting(q, scripts) == 0, "a second copy went back to the queue"
    assert scripts.client.hexists(scripts.keys.unacked, again.delivery_tag), "the live claim stays unacked"


def waiting(q: RedisQueue, scripts: HolderScripts) -> int:
    """How many messages wait in ``q``'s lists (behind its global_keyprefix)."""
    prefix = redis_claim.key_prefix(q.channel)
    return sum(int(scripts.client.llen(prefix + name)) for name in redis_claim.priority_lists(q.channel, q.name))


def test_an_expired_record_restored_and_claimed_again_is_not_restored_by_a_second_restorer(
        holders_of: Callable[..., tuple[RedisQueue, HolderScripts]]) -> None:
    q, scripts = holders_of(visibility_timeout=0)
    q.publish("stock")
    q.claim(1)  # a stock worker's claim, in no held set
    ceiling = time.time() + 1
    first_read = scripts.expired_unheld(ceiling, -1)
    second_read = scripts.expired_unheld(ceiling, -1)
    assert first_read == second_read and len(first_read) == 1

    scripts.restore(scripts.take_expired(first_read, ceiling, time.time()))
    items, [tag], _ = q.claim(1)  # claimed again: a fresh claim time
    assert tag.decode() == first_read[0]
    # The second restorer's ceiling is its own, read with its list: the fresh claim is after it now.
    assert scripts.take_expired(second_read, ceiling - 1, time.time()) == []
    assert queued(q) == []
