"""Durable beat gauges on celery_durable's registry, set by the replica itself as it leads and sends.

``durable_beat_leader{beat}``: 1 on the replica leading, 0 on a standby.
``durable_beat_last_fire_timestamp{beat,entry}``: when the entry's last send was made (Unix seconds).
``durable_beat_lag_seconds{beat,entry}``: how late that send was (its send time less its tick's time).
"""

from __future__ import annotations

from datetime import datetime

from prometheus_client import Gauge

from celery_durable.metrics.registry import REGISTRY

LEADER = Gauge("durable_beat_leader", "1 while this beat replica leads, 0 while it stands by", ["beat"],
               registry=REGISTRY)
LAST_FIRE = Gauge("durable_beat_last_fire_timestamp", "Unix time of the entry's last send by this replica",
                  ["beat", "entry"], registry=REGISTRY)
LAG = Gauge("durable_beat_lag_seconds", "Seconds between the entry's last send and the tick it stands for",
            ["beat", "entry"], registry=REGISTRY)


def leading(beat: str, leads: bool) -> None:
    LEADER.labels(beat=beat).set(1 if leads else 0)


def fired(beat: str, entry: str, tick: datetime, at: datetime) -> None:
    LAST_FIRE.labels(beat=beat, entry=entry).set(at.timestamp())
    LAG.labels(beat=beat, entry=entry).set(max((at - tick).total_seconds(), 0.0))
