"""The durable store: runs and steps in SQL (SQLAlchemy Core), with its Alembic migrations."""
