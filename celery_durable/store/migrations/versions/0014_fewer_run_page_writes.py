"""Fewer pages written per run: the finished-at index holds finished runs only.

Measured (``benchmarks/run_pages.py``, SQLite, a new 3-step run after 2,000 others): 16.9 WAL frames
(pages written) per run, 3.2 of them in ``ix_durable_runs_finished_at``: each start wrote a NULL
entry there that its settle then moved to the end of the index. Over ``WHERE finished_at IS NOT
NULL`` the index is written once, by the settle (1.2 frames a run). Run retention's query names
``finished_at IS NOT NULL`` (and ``finished_at < :before`` implies it), so it still uses the index,
on both databases. PostgreSQL's start likewise inserts one index entry fewer.

Not done: ``durable_steps`` as a SQLite ``WITHOUT ROWID`` table. It saved 2.6 frames a run with
integer step results, but its rows (results included) go in at random places of one B-tree keyed on
the run id, and rows of a few hundred bytes split its leaves often: 300-byte results cost 0.6 frames
a run more than the rowid table (appended in order) and its key index, 600-byte ones 1.8 more.

Revision ID: 0014_fewer_run_page_writes
Revises: 0013_beat_schedule
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_fewer_run_page_writes"
down_revision = "0013_beat_schedule"
branch_labels = None
depends_on = None

FINISHED = "finished_at IS NOT NULL"


def upgrade() -> None:
    op.drop_index("ix_durable_runs_finished_at", "durable_runs")
    op.create_index("ix_durable_runs_finished_at", "durable_runs", ["finished_at"],
                    sqlite_where=sa.text(FINISHED), postgresql_where=sa.text(FINISHED))


def downgrade() -> None:
    op.drop_index("ix_durable_runs_finished_at", "durable_runs")
    op.create_index("ix_durable_runs_finished_at", "durable_runs", ["finished_at"])
