"""Celery canvas internals the outbox needs to store a chain as the one message ``chain.apply_async`` sends.

Celery has no public API for "the message a chain would publish": ``_chain.run``
builds it from ``prepare_steps`` and ``Signature._merge``. The outbox does the
same, so a chain committed through it is the chain Celery would have sent.
"""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature, _chain, _chord, chain

#: The chain classes: ``chain(...)`` returns a ``_chain`` (Celery >= 4; ``chain`` itself since 5.0).
CHAIN_TYPES: tuple[type, ...] = (_chain, chain)
#: ``chord`` is a function returning a ``_chord`` (a group subclass) in every 5.x.
CHORD_TYPE: type = _chord


def is_chain(sig: Any) -> bool:
    return type(sig) in CHAIN_TYPES


def is_chord(sig: Any) -> bool:
    return isinstance(sig, CHORD_TYPE)


def chain_uses_links(sig: Any) -> bool | None:
    """``_chain._use_link``: True/False when the chain says, None to follow ``task_protocol`` (5.x)."""
    value: bool | None = sig._use_link
    return value


def prepare_chain_steps(sig: Any, app: Any, last_task_id: str | None) -> tuple[list[Any], list[Any]]:
    """``_chain.prepare_steps`` as ``_chain.run`` calls it (celery 5.5–5.7: 10 positional args + group_index).

    Returns the cloned, frozen steps (last step first) and their results.
    """
    steps, results = sig.prepare_steps(sig.args, {}, sig.tasks, None, None, None, app,
                                       last_task_id, None, None, group_index=None)
    return list(steps), list(results)


def merged_call(sig: Signature, options: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``Signature._merge``: the args, kwargs and options ``Signature.apply_async`` would send (5.x)."""
    args, kwargs, merged = sig._merge((), {}, options)
    return args, kwargs, dict(merged)
