"""The few exceptions callers of celery_durable catch, each naming what was wrong."""

from __future__ import annotations


class DurableError(Exception):
    """Base of every error celery_durable raises on purpose.

    ``code`` is a stable identifier for logs and alerts; ``setting`` names the
    ``durable_*`` setting at fault, when one is.
    """

    code = "durable.error"

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.setting = setting

    def __reduce__(self) -> tuple[object, ...]:
        # Celery moves exceptions between processes: keep them picklable with
        # their keyword-only fields.
        return (_rebuild, (type(self), self.message, self.setting))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[DurableError], message: str, setting: str | None) -> DurableError:
    return cls(message, setting=setting)


class SleepHandOff(BaseException):
    """A durable sleep handing its run to the wake-up message: this execution ends here.

    A ``BaseException``, as DBOS's control exceptions are, so a task body's
    ``except Exception`` cannot swallow it and carry on awake; the execution
    turns it into Celery's ``Ignore`` once it leaves the body.
    """

    def __init__(self, step: str, wake_in: float) -> None:
        # Both in args: the default pickling rebuilds the exception from them.
        super().__init__(step, wake_in)
        self.step = step
        self.wake_in = wake_in

    def __str__(self) -> str:
        return f"durable sleep {self.step!r}: woken again in {self.wake_in:.3f}s"


class LeaseLost(BaseException):
    """This attempt no longer holds its run's lease, found when a step's checkpoint was fenced out.

    Another attempt took the run over (this one's process froze past the lease
    TTL) or a cancel settled it: the step is not recorded (a transactional
    step's effects roll back with it) and this execution ends. A
    ``BaseException``, like :class:`SleepHandOff`, so a body's
    ``except Exception`` cannot swallow it and run on; the execution turns it
    into Celery's ``Ignore`` (no retry spent, nothing failed).
    """

    def __init__(self, run_id: str, step: str) -> None:
        # Both in args: the default pickling rebuilds the exception from them.
        super().__init__(run_id, step)
        self.run_id = run_id
        self.step = step

    def __str__(self) -> str:
        return (f"durable run {self.run_id}: lease lost before step {self.step!r} was recorded "
                f"(taken over by another attempt, or cancelled)")


class ConfigInvalid(DurableError):
    """A ``durable_*`` setting holds a value the worker cannot run with."""

    code = "durable.config.invalid"

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}", setting=setting)
        self.problem = problem

    def __reduce__(self) -> tuple[object, ...]:
        return (ConfigInvalid, (self.setting, self.problem))


class InvariantBroken(DurableError):
    """A constructor was handed values that break one of its invariants."""

    code = "durable.invariant"


class NotDurable(DurableError):
    """A durable-only call (``step()``, ``sleep()``) was made outside a durable run."""

    code = "durable.run.outside"


class StepNameInvalid(DurableError):
    """A step name the steps table cannot hold: not a non-empty string, a NUL, a lone surrogate, too long."""

    code = "durable.step.name_invalid"


class RunExhausted(DurableError):
    """A run that started more times than its retries allow without ever recording an end.

    Its process died on each attempt (an OOM, a segfault): it is buried dead
    instead of crash-looping the fleet; ``runs.requeue`` gives it a fresh budget.
    """

    code = "durable.run.exhausted"


class RunIdInvalid(DurableError):
    """A Celery task id the runs table cannot hold as a run's id (empty, too long, a NUL, a lone surrogate)."""

    code = "durable.run.id_invalid"


class NotJSON(DurableError):
    """A value that must be stored (a step result, a run's arguments or result) does not round-trip through JSON."""

    code = "durable.json.invalid"


class StoreUnavailable(DurableError):
    """The durable store's database could not be reached; nothing was recorded half-way."""

    code = "durable.store.unavailable"


class SchemaOutdated(DurableError):
    """The database's durable schema is not the revision this code needs: run the migrations."""

    code = "durable.store.schema_outdated"


class RunNotFound(DurableError):
    """No durable run has this id."""

    code = "durable.run.not_found"


class RunNotDead(DurableError):
    """Only a dead run can be requeued."""

    code = "durable.run.not_dead"


class RunSettled(DurableError):
    """A run that has settled (succeeded, dead, cancelled) cannot be cancelled."""

    code = "durable.run.settled"


class OutboxInvalid(DurableError):
    """``outbox.enqueue`` was handed something a row cannot hold (a canvas, an option, a non-JSON argument)."""

    code = "durable.outbox.invalid"


class OutboxDatabaseMismatch(DurableError):
    """``outbox.enqueue`` was handed a session or connection on a database other than the durable store.

    The row must commit in the caller's transaction, and the relay reads the
    durable store: the two must be the same database.
    """

    code = "durable.outbox.database_mismatch"


class TransactionUnsupported(DurableError):
    """``celery_durable.transaction()`` on a broker that cannot take part in the caller's transaction.

    Only the PostgreSQL broker (``durable+postgresql://``) keeps its messages in a database a
    caller's transaction can write to; on Redis or RabbitMQ ``outbox.enqueue`` and its relay
    make "commit and send" atomic instead.
    """

    code = "durable.outbox.transaction_unsupported"


class TransactionEnded(DurableError):
    """A publish inside ``celery_durable.transaction()`` after the caller's connection was closed."""

    code = "durable.outbox.transaction_ended"


class HostIncompatible(DurableError):
    """The installed Celery, kombu, billiard or py-amqp lacks an internal ``-P durable`` relies on."""

    code = "durable.host.incompatible"


class BeatEntryInvalid(DurableError):
    """A ``beat_schedule`` entry the durable beat cannot run: refused at start, naming the entry."""

    code = "durable.beat.entry_invalid"


class ScheduleEditRefused(DurableError):
    """An add, edit or remove of a stored beat entry refused: the name is the app's ``beat_schedule``'s
    (read-only at run time), already stored (add), or not stored (edit, remove)."""

    code = "durable.beat.edit_refused"
