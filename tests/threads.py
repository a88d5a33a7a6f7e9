"""Run one function on several threads at once, for tests of racing store callers."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_together(target: Callable[[int], None], count: int) -> None:
    """``target(0)`` .. ``target(count - 1)``, each on its own thread; fails with the errors any raised."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            target(n)
        except BaseException as err:  # noqa: BLE001 - reported below, with the others
            errors.append(err)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
