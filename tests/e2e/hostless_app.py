"""The e2e app with one host internal removed, as a Celery or kombu upgrade might remove it.

E2E_REMOVE_HOST_NAME names it as ``module:Owner.attribute`` (or ``module:attribute``).
"""

from __future__ import annotations

import importlib
import os

from tests.e2e.e2eapp import app

module_name, _, path = os.environ["E2E_REMOVE_HOST_NAME"].partition(":")
owner_path, _, attribute = path.rpartition(".")
owner: object = importlib.import_module(module_name)
for part in filter(None, owner_path.split(".")):
    owner = getattr(owner, part)
delattr(owner, attribute)

__all__ = ["app"]
