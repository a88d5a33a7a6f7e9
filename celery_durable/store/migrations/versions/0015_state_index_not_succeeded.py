"""Fewer pages written per run: the state index leaves out ``succeeded`` runs.

Measured (``benchmarks/run_pages.py``, SQLite, a new 3-step run after 2,000 others): 15.0 WAL frames
(pages written) per run, 3.1 of them in ``ix_durable_runs_state``: the start wrote a ``running`` entry
and the settle deleted it and wrote a ``succeeded`` one at the end of that state's range, a second
leaf page. Over ``WHERE state <> 'succeeded'`` the settle of a run that succeeded only deletes: ~1
page a run less. Nearly every run ends ``succeeded``, so the index also shrinks to the live, failed,
dead and cancelled runs the store's own reads look for (recovery, sleeping runs, dead runs).

SQLite uses a partial index only for a query that repeats its condition, so every read by state
names ``state <> 'succeeded'`` (``store/runs.py``); a read of succeeded runs goes through the
finished-at index (retention) or the table (a listing, as an unfiltered one always did), and the
count by state takes the succeeded runs as the total less the others.

Not done (measured with a plain-sqlite3 replica of a run's statements, 300 runs after 2,000): keying
``durable_steps`` by an integer run sequence instead of the random task id would append its key index
in order instead of splitting random leaves: 0.7, 1.1 and 1.2 frames a run fewer as a rowid table
(integer, 300 and 600-byte results); as ``WITHOUT ROWID`` on that key, 3.2, 1.6 and 0.2 fewer (appended
fat rows still split its leaves). It needs a stable sequence column on
runs (SQLite's implicit rowid may change on VACUUM) and the fence and loads to join through it.

Revision ID: 0015_state_index_not_succeeded
Revises: 0014_fewer_run_page_writes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_state_index_not_succeeded"
down_revision = "0014_fewer_run_page_writes"
branch_labels = None
depends_on = None

NOT_SUCCEEDED = "state <> 'succeeded'"


def upgrade() -> None:
    op.drop_index("ix_durable_runs_state", "durable_runs")
    op.create_index("ix_durable_runs_state", "durable_runs", ["state"],
                    sqlite_where=sa.text(NOT_SUCCEEDED), postgresql_where=sa.text(NOT_SUCCEEDED))


def downgrade() -> None:
    op.drop_index("ix_durable_runs_state", "durable_runs")
    op.create_index("ix_durable_runs_state", "durable_runs", ["state"])
