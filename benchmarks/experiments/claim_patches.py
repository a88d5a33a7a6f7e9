"""EXPERIMENT, not product code: the benchmark app with candidate claimer changes patched in.

Evidence for the suggestions in ``benchmarks/RESULTS.md``; each patch is a
monkeypatch of ``celery_durable.worker.claimer.Claimer`` applied when a worker
imports this module, chosen with EXP_PATCHES (comma list; default "pending,pipeline,firstpass,admitfirst"):

  batch       Redis: an ask for n is ONE round trip — a Lua script pops up to n
              messages and records each in kombu's unacked hash/index atomically.
              (Landed in the package as worker/fetchers.py in b2c6740; kept here
              only to reproduce the before/after figures on older commits.)
  arm         arm the idle any-queue wait only when some ask of the pass came back
              short and no kick is pending (a pass that used all its room is
              followed by a kick for every slot freed since).
  pipeline    AMQP: an ask for n writes n Basic.Get frames at once and then reads
              the n replies: one round trip per ask instead of one per message.
  pending     the smaller form of arm: skip arming only while a kick is pending
              (the pass it schedules re-plans anyway).
  admitfirst  on an idle delivery, hand the run to the pool before cancelling the
              wait's consumers (the wait's channel has a global prefetch of 1).
  firstpass   run the first claim pass inside consume(), before the worker says
              "ready": Celery's asynloop queues a blocking 100 ms drain
              (_quick_drain) on AMQP beside the first kick, in a set, so the first
              pass — and the idle wait — can come up to 100 ms after "ready".

    /work/venv/bin/python benchmarks/worker_bench.py --experiment claim_patches [--scenarios throughput]

runs every durable variant twice in the same run: as shipped, and with these patches.
"""

from __future__ import annotations

import os
from time import time
from typing import Any

from kombu.serialization import prepare_accept_content
from kombu.transport.virtual.base import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from benchapp import app, noop, ping, work  # noqa: F401  (the same tasks as the benchmark)
from celery_durable.worker import claimer as _claimer

Claimer = _claimer.Claimer
PATCHES = set(os.environ.get("EXP_PATCHES", "pending,pipeline,firstpass,admitfirst").split(","))

# KEYS: unacked_index, unacked, then the queue's priority lists in kombu's order.
# Stores the same unacked entry kombu's QoS.append does: [payload, exchange, routing_key].
CLAIM_LUA = """
local n = tonumber(ARGV[1])
local out = {}
for k = 3, #KEYS do
  if #out >= n then break end
  local items = redis.call('RPOP', KEYS[k], n - #out)
  if items then
    for _, raw in ipairs(items) do
      local props = cjson.decode(raw)['properties']
      local tag = props['delivery_tag']
      local di = props['delivery_info']
      redis.call('ZADD', KEYS[1], ARGV[2], tag)
      redis.call('HSET', KEYS[2], tag,
        '[' .. raw .. ',' .. cjson.encode(di['exchange']) .. ',' .. cjson.encode(di['routing_key']) .. ']')
      out[#out + 1] = raw
    end
  end
end
return out
"""

_original_fetch = Claimer._fetch
_original_run_pass = Claimer.run_pass
_original_arm = Claimer._arm_idle_wait
_original_idle_delivery = Claimer._idle_delivery
_original_start = Claimer.start


def _fetch_batched(self: Any, queue: Any, count: int) -> int:
    if self._connection.transport.driver_type != "redis":
        return _original_fetch(self, queue, count)
    channel = self._claim_channel
    script = getattr(self, "_claim_script", None)
    if script is None:
        with channel.conn_or_acquire() as client:
            script = self._claim_script = client.register_script(CLAIM_LUA)
        self._claim_accept = prepare_accept_content(self._accept)
    keys = [channel.unacked_index_key, channel.unacked_key,
            *(channel._q_for_pri(queue.name, p) for p in channel.priority_steps)]
    with channel.conn_or_acquire() as client:
        raws = script(keys=keys, args=[count, time()], client=client) or []
    for raw in raws:
        message = channel.Message(loads(bytes_to_str(raw)), channel=channel)
        VirtualQoS.append(channel.qos, message, message.delivery_tag)  # kombu's in-process bookkeeping
        message.accept = self._claim_accept
        # Already off the broker: admitted even if stop() came meanwhile (the drain hands it back).
        self._admit(queue.name, message)
    return len(raws)


def _fetch_noting_dry(self: Any, queue: Any, count: int) -> int:
    got = _fetch(self, queue, count)
    if got < count:
        self._pass_found_dry = True
    return got


def _run_pass_noting_dry(self: Any) -> int:
    self._pass_found_dry = False
    return _original_run_pass(self)


def _arm_when_dry(self: Any, queues: Any) -> None:
    if not getattr(self, "_pass_found_dry", True) or self._kick_pending:
        return
    _original_arm(self, queues)


def _arm_unless_kick_pending(self: Any, queues: Any) -> None:
    if self._kick_pending:
        return
    _original_arm(self, queues)


def _idle_delivery_admit_first(self: Any, queue_name: str, messages: list[Any]) -> Any:
    def on_message(message: Any) -> None:
        messages.append(message)
        self.cursor = queue_name
        consumers, self._idle_consumers = self._idle_consumers, []
        self._admit(queue_name, message)
        self._idle_consumers = consumers + self._idle_consumers
        self._cancel_idle_wait()
        self.kick()
    return on_message


def _fetch_pipelined(self: Any, queue: Any, count: int) -> int:
    if self._connection.transport.driver_type != "amqp" or count < 2:
        return (_fetch_batched if "batch" in PATCHES else _original_fetch)(self, queue, count)
    from amqp import spec

    channel = self._claim_channel
    accept = getattr(self, "_claim_accept", None)
    if accept is None:
        accept = self._claim_accept = prepare_accept_content(self._accept)
    for _ in range(count):
        channel.send_method(spec.Basic.Get, "Bsb", (0, queue.name, False))
    got = 0
    for _ in range(count):
        # Replies come back in order; every Get must be read even after a stop
        # (a GetOk is a message this worker now holds: it is admitted).
        reply = channel.wait([spec.Basic.GetOk, spec.Basic.GetEmpty], returns_tuple=True)
        if not reply or len(reply) < 2:
            continue
        message = channel.message_to_python(channel._on_get_ok(*reply))
        message.accept = accept
        got += 1
        self._admit(queue.name, message)
    return got


_fetch = _fetch_batched if "batch" in PATCHES else _original_fetch
if "pipeline" in PATCHES:
    _fetch = _fetch_pipelined
if "arm" in PATCHES:
    Claimer._fetch = _fetch_noting_dry
    Claimer.run_pass = _run_pass_noting_dry
    Claimer._arm_idle_wait = _arm_when_dry
else:
    Claimer._fetch = _fetch
if "pending" in PATCHES and "arm" not in PATCHES:
    Claimer._arm_idle_wait = _arm_unless_kick_pending
if "admitfirst" in PATCHES:
    Claimer._idle_delivery = _idle_delivery_admit_first


def _start_with_first_pass(self: Any) -> None:
    _original_start(self)
    # consume() runs on the loop thread before on_ready(): claim (and arm the
    # idle wait) now, as stock Celery's basic_consume does before "ready".
    self._kicked()


if "firstpass" in PATCHES:
    Claimer.start = _start_with_first_pass
