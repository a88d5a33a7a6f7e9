"""Pure planners: no Celery, kombu, SQLAlchemy or clock imports, so rules are tested from tables."""
