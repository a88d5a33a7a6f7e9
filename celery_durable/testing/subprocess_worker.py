"""A real ``celery worker -P durable`` subprocess for a test: started, waited for, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: How long a worker may take to say it is ready, and to exit after SIGTERM.
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


class DurableWorker:
    """A running ``celery worker -P durable`` subprocess."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"the durable worker exited with {self.process.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the durable worker was not ready after {timeout:.0f}s:\n"
                                     f"{self.log()[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (a warm shutdown: running runs finish) and the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the durable worker did not exit within {timeout:.0f}s of SIGTERM:\n"
                                 f"{self.log()[-3000:]}") from None


def start_subprocess_worker(app_path: str, settings: Mapping[str, Any], *, queues: Sequence[str] | None,
                            concurrency: int, node_name: str, log_path: Path) -> DurableWorker:
    """``celery -A app_path worker -P durable`` with ``settings`` applied after the app's own (not yet ready)."""
    argv = [sys.executable, "-m", "celery_durable.testing.launch", app_path, json.dumps(dict(settings)),
            "worker", "-P", "durable", "-c", str(concurrency), "-l", "info",
            "--without-mingle", "--without-gossip", "-n", node_name]
    if queues:
        argv += ["-Q", ",".join(queues)]
    # The app must import in the worker as it does here (pytest puts the rootdir on sys.path).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, sys.path)])}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return DurableWorker(process, log_path)
