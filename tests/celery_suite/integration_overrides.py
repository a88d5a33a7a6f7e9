"""Appended to Celery's own t/integration/conftest.py: its session worker runs the pool CELERY_SUITE_POOL names.

With ``durable``, celery_durable is installed on the session app and on each test's app, as a user installs it
in every process that sends tasks; with any other pool (``prefork``: stock), celery_durable is not imported.
Defined after Celery's fixtures in the same module, so these replace them.
"""

import os as _os

import pytest as _pytest

_POOL = _os.environ.get("CELERY_SUITE_POOL", "durable")


@_pytest.fixture(scope="session")
def celery_worker_pool():
    return _POOL


@_pytest.fixture(scope="session", autouse=True)
def _durable_installed_on_the_session_app(celery_session_app):
    # Autouse and session-scoped: set up before the session worker starts.
    if _POOL == "durable":
        import celery_durable

        celery_durable.install(celery_session_app)


@_pytest.fixture(autouse=True)
def _durable_installed_on_the_test_app(celery_app):
    if _POOL == "durable":
        import celery_durable

        celery_durable.install(celery_app)
