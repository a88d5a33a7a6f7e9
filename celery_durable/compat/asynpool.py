"""The prefork pool's event-loop side: children reaped and added at once, jobs written at once, kept at a flush."""

from __future__ import annotations

from time import monotonic
from typing import Any

from billiard.pool import RUN
from celery.concurrency.asynpool import AsynPool


class ReapingAsynPool(AsynPool):
    """Celery's ``AsynPool`` that keeps looking for a child whose exit came early.

    AsynPool learns that a child exited when the child's sentinel pipe turns
    readable; it then stops watching the sentinel and runs ``maintain_pool``
    once, which reaps the child and forks its replacement. But the kernel
    closes a dying process's files before it makes the process waitable, and
    a parent woken in between finds no exit code: the child stays listed as
    alive and nothing forks a replacement (or gives back a job written to the
    dead child's pipe) until the 5 s ``maintain_pool`` timer. With
    ``--max-tasks-per-child`` that delays the next task by up to 5 s after a
    child is recycled. Here a child still listed after its exit was seen is
    looked for again shortly, until it is reaped.
    """

    #: First delay, then the longest, between two looks for the child (seconds).
    reap_first_delay = 0.005
    reap_max_delay = 0.1
    #: Stop looking after this long: a child that closed its sentinel without
    #: exiting is left to Celery's periodic ``maintain_pool``.
    reap_give_up_after = 5.0

    def grow(self, n: int = 1) -> None:
        """Add ``n`` children now (``celery control pool_grow``).

        billiard's ``Pool.grow`` only raises the target; the children come at the
        next ``maintain_pool`` (Celery's 5 s timer). ``-P durable`` raises its
        capacity at once, and the runs it claims for the new room would wait in
        the pool for processes that do not exist yet.
        """
        super().grow(n)
        self.maintain_pool()

    def _create_write_handlers(self, hub: Any, *args: Any, **kwargs: Any) -> None:
        """Celery's write handlers, and a job handed to the pool written to an idle child's pipe at once.

        Celery's ``send_job`` only queues the job: every round of the loop then
        registers each idle child's pipe with the poller for writing, the next
        poll finds them writable and the consolidated ``schedule_writes`` writes
        the job, and the round after unregisters them (an ``epoll_ctl`` a pipe
        each way per job, and a poll between the delivery and the child's start).
        A ``-P durable`` worker hands the pool a run only for a free slot, so an
        idle child is almost always there: its pipe is given to ``schedule_writes``
        now, which pops the oldest queued job and writes it (a full pipe makes it
        park the write on the poller, as Celery's own first try does). With no
        idle child the job waits for the loop, as before.
        """
        super()._create_write_handlers(hub, *args, **kwargs)
        queue_job: Any = self._quick_put  # type: ignore[has-type]
        write_queued = hub.consolidate_callback
        all_inqueues, active_writes, busy = self._all_inqueues, self._active_writes, self._busy_workers

        def send_job_at_once(job: Any) -> None:
            queue_job(job)
            for fd in all_inqueues:
                if fd not in active_writes and fd not in busy:
                    write_queued([fd])
                    return

        self._quick_put = send_job_at_once

    def flush(self) -> None:
        """Forget the jobs no child has, as Celery does; keep the ones already in a child's pipe.

        The consumer flushes the pool when it closes (SIGTERM, a lost connection).
        Celery's ``AsynPool.flush`` drops from the pool's cache every job whose
        ACK it has not read, as if no child had it; but a job written to a
        child's pipe runs there all the same. Dropped, its result is never read:
        the pool's shutdown loop reads the children's pipes only while the cache
        holds a job, the child then waits 30 s for the read before it exits
        (billiard's ``_ensure_messages_consumed``), the run's callbacks never
        fire, and with ``acks_late`` its message is restored at close and runs
        again. Kept, the join reads its ACK and result like any other run's; the
        drain's deadline still bounds it (the child is killed, the run handed back).
        """
        in_children = [job for job in self._cache.values() if _in_a_childs_pipe(job)]
        super().flush()
        for job in in_children:
            self._cache.setdefault(job._job, job)

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        super()._event_process_exit(hub, proc)
        self._look_again(hub, proc, self.reap_first_delay, monotonic() + self.reap_give_up_after)

    def _look_again(self, hub: Any, proc: Any, delay: float, give_up_at: float) -> None:
        if self._state != RUN or not self._still_listed(proc) or monotonic() + delay > give_up_at:
            return
        hub.call_later(delay, self._reap, hub, proc, delay, give_up_at)

    def _reap(self, hub: Any, proc: Any, delay: float, give_up_at: float) -> None:
        if self._state != RUN or not self._still_listed(proc):
            return
        self.maintain_pool()
        self._look_again(hub, proc, min(delay * 2, self.reap_max_delay), give_up_at)

    def _still_listed(self, proc: Any) -> bool:
        return any(listed is proc for listed in self._pool)


def _in_a_childs_pipe(job: Any) -> bool:
    """A job not yet acknowledged by a child whose writing to a live child's pipe has begun.

    Celery's flush finishes every write it began (a pipe must not hold half a
    message), so such a job reaches the child whole.
    """
    child = getattr(job, "_write_to", None)
    return not job._accepted and child is not None and child._is_alive()
