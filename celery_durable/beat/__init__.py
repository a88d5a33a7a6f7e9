"""The durable beat: ``celery beat -S celery_durable.Scheduler`` on any number of hosts, one leading."""
