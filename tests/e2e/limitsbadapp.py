"""An app whose one task declares the fleet-limit options in E2E_LIMIT_OPTIONS (JSON), to be refused at boot.

``"durable_key": true`` stands for a key function (JSON cannot carry one).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.e2e.e2eapp import app

_options = json.loads(os.environ.get("E2E_LIMIT_OPTIONS", "{}"))
if _options.get("durable_key") is True:
    _options["durable_key"] = lambda org, *args, **kwargs: f"org:{org}"


@app.task(name="limits.bad", **_options)
def bad(org: Any) -> Any:
    return org
