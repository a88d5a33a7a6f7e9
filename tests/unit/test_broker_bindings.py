"""broker.bindings.SharedTables: which lookups read the shared bindings anew and which reuse a read."""

from __future__ import annotations

from celery_durable.broker.bindings import SharedTables
from celery_durable.compat.row_exchanges import Meta


class Reads:
    def __init__(self) -> None:
        self.count = 0
        self.table: list[Meta] = [("#", "^.*?$", "ev.m1")]

    def __call__(self, exchange: str) -> list[Meta]:
        self.count += 1
        return list(self.table)


def test_a_read_is_reused_until_it_is_max_age_old_unless_fresh_is_asked() -> None:
    now = [100.0]
    reads = Reads()
    tables = SharedTables(reads, max_age=1.0, clock=lambda: now[0])
    assert tables.get("ev", fresh=False) == [("#", "^.*?$", "ev.m1")]
    reads.table.append(("#", "^.*?$", "ev.m2"))
    now[0] += 0.9
    assert len(tables.get("ev", fresh=False)) == 1 and reads.count == 1
    assert len(tables.get("ev", fresh=True)) == 2 and reads.count == 2
    reads.table.append(("#", "^.*?$", "ev.m3"))
    now[0] += 1.0
    assert len(tables.get("ev", fresh=False)) == 3 and reads.count == 3


def test_each_exchange_is_read_on_its_own() -> None:
    reads = Reads()
    tables = SharedTables(reads, clock=lambda: 0.0)
    tables.get("a", fresh=False)
    tables.get("b", fresh=False)
    tables.get("a", fresh=False)
    assert reads.count == 2
