"""Fewer pages written per run: SQLite's steps table WITHOUT ROWID, and the finished-at index only over finished runs.

Measured (``benchmarks/run_pages.py``, SQLite, a new 3-step run after 2,000 others): 16.9 WAL frames
(pages written) per run, of which a checkpoint wrote two B-trees each — the steps table's rowid
B-tree and its primary-key index (``sqlite_autoindex_durable_steps_1``) — and the finished-at index
3.2: the start wrote a NULL entry that the settle then moved. As a WITHOUT ROWID table the steps are
one B-tree keyed on (run_id, name, occurrence), a run's checkpoints side by side; an index only
``WHERE finished_at IS NOT NULL`` is written once, by the settle. Run retention's query names
``finished_at IS NOT NULL`` (and ``finished_at < :before`` implies it), so it still uses the index,
on both databases.

PostgreSQL has no WITHOUT ROWID (a heap and its primary key, as before); the partial index saves
its start one index insertion there too.

SQLite's upgrade copies the steps into the new table in the migration's transaction: a large store
takes a while, once.

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
STEP_COLUMNS = "run_id, name, occurrence, result, created_at"


def upgrade() -> None:
    op.drop_index("ix_durable_runs_finished_at", "durable_runs")
    op.create_index("ix_durable_runs_finished_at", "durable_runs", ["finished_at"],
                    sqlite_where=sa.text(FINISHED), postgresql_where=sa.text(FINISHED))
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_steps(with_rowid=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_steps(with_rowid=True)
    op.drop_index("ix_durable_runs_finished_at", "durable_runs")
    op.create_index("ix_durable_runs_finished_at", "durable_runs", ["finished_at"])


def _rebuild_steps(*, with_rowid: bool) -> None:
    # SQLite cannot change a table's storage in place: a copy under another name, then the swap.
    # Nothing references durable_steps, so dropping and renaming it leaves every foreign key whole.
    op.create_table(
        "durable_steps_rebuilt",
        sa.Column("run_id", sa.String(255), sa.ForeignKey("durable_runs.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("occurrence", sa.Integer, primary_key=True),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_with_rowid=with_rowid,
    )
    op.execute(f"INSERT INTO durable_steps_rebuilt ({STEP_COLUMNS}) SELECT {STEP_COLUMNS} FROM durable_steps")
    op.drop_table("durable_steps")
    op.rename_table("durable_steps_rebuilt", "durable_steps")
