"""Every metric celery_durable exports, on one registry this package owns; the rest of the package calls it."""
