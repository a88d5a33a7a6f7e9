"""compat.canvas: the chain internals the outbox uses build the message ``chain.apply_async`` sends."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery import Celery, chain, chord, group

from celery_durable.compat.canvas import (
    chain_uses_links,
    is_chain,
    is_chord,
    merged_call,
    prepare_chain_steps,
)
from tests.compat.conftest import TaskMessage


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _without_task_id(step: dict[str, Any]) -> dict[str, Any]:
    # Ids of the steps before the last are new uuids on every prepare_steps.
    return {**step, "options": {k: v for k, v in step["options"].items() if k != "task_id"}}


def test_chain_is_the_type_chain_and_pipe_build(app: Celery) -> None:
    add, mul = app.tasks["compat.add"], app.tasks["compat.mul"]
    assert is_chain(chain(add.s(1, 2), mul.s(3)))
    assert is_chain(add.s(1, 2) | mul.s(3))
    assert not is_chain(add.s(1, 2))


def test_chain_use_link_is_none_unless_the_chain_says(app: Celery) -> None:
    add, mul = app.tasks["compat.add"], app.tasks["compat.mul"]
    assert chain_uses_links(chain(add.s(1, 2), mul.s(3))) is None
    assert chain_uses_links(add.s(1, 2) | mul.s(3)) is None
    assert chain_uses_links(chain(add.s(1, 2), mul.s(3), use_link=False)) is False
    assert chain_uses_links(chain(add.s(1, 2), mul.s(3), use_link=True)) is True


def test_chord_is_the_type_chord_builds(app: Celery) -> None:
    add, mul = app.tasks["compat.add"], app.tasks["compat.mul"]
    assert is_chord(chord([add.s(1, 2), add.s(3, 4)], mul.s(2)))
    assert not is_chord(group(add.s(1, 2), add.s(3, 4)))
    assert not is_chord(chain(add.s(1, 2), mul.s(3)))


def test_chain_prepare_steps_returns_frozen_steps_last_first(app: Celery) -> None:
    add, mul = app.tasks["compat.add"], app.tasks["compat.mul"]
    sig = chain(add.s(1, 2), mul.s(3), add.s(4))
    steps, results = prepare_chain_steps(sig, app, "the-last-id")
    assert [(s.task, tuple(s.args)) for s in steps] == [("compat.add", (4,)), ("compat.mul", (3,)),
                                                        ("compat.add", (1, 2))]
    assert all(s.id for s in steps), "every step is frozen with its task id"
    assert len({s.id for s in steps}) == 3
    assert steps[0].id == "the-last-id"
    # Results line up with the steps, each linked to the one before it.
    assert [r.id for r in results] == [s.id for s in steps]
    assert results[0].parent.id == steps[1].id and results[1].parent.id == steps[2].id
    assert results[2].parent is None
    # The chain itself is left as it was (prepare_steps cloned its tasks).
    assert all(not t.options.get("task_id") for t in sig.tasks)


def test_chain_prepare_steps_builds_the_message_chain_apply_async_sends(app: Celery,
                                                                        task_message: TaskMessage) -> None:
    add, mul = app.tasks["compat.add"], app.tasks["compat.mul"]
    sig = chain(add.s(1, 2), mul.s(3), add.s(4))
    options = {"countdown": 30, "priority": 3}
    sent = task_message(sig, task_id="the-last-id", **options)
    args, kwargs, embed = sent.decode()

    steps, _ = prepare_chain_steps(sig, app, "the-last-id")
    first = steps.pop()
    ours_args, ours_kwargs, ours_options = merged_call(first, options)

    assert sent.headers["task"] == first.task
    assert _as_json([ours_args, ours_kwargs]) == [args, kwargs]
    assert ours_options["countdown"] == 30 and ours_options["priority"] == 3
    assert sent.properties["priority"] == 3 and sent.headers["eta"]
    # The rest of the chain rides in the first message, last step first, its last id ours.
    assert embed["chain"][0]["options"]["task_id"] == "the-last-id" == steps[0].id
    assert [_without_task_id(s) for s in embed["chain"]] == [_without_task_id(_as_json(dict(s))) for s in steps]


@pytest.mark.parametrize(
    ("make", "options"),
    [
        pytest.param(lambda t: t.s(1, 2).set(queue="q1", priority=1), {"queue": "q2", "countdown": 5},
                     id="options-override-the-signatures"),
        pytest.param(lambda t: t.si(1, 2).set(expires=60), {"queue": "q2", "task_id": "given"},
                     id="immutable-signature"),
        pytest.param(lambda t: t.s(1).set(stamped_headers=["tenant"], tenant="a"), {"tenant": "b", "queue": "q2"},
                     id="stamped-headers-stay"),
    ],
)
def test_signature_merge_gives_what_signature_apply_async_sends(app: Celery, monkeypatch: pytest.MonkeyPatch,
                                                                make: Any, options: dict[str, Any]) -> None:
    add = app.tasks["compat.add"]
    sent: list[tuple[Any, Any, dict[str, Any]]] = []
    # Signature.apply_async hands its merged call to the task's apply_async.
    monkeypatch.setattr(add, "apply_async", lambda args=None, kwargs=None, **opts: sent.append((args, kwargs, opts)))
    make(add).apply_async(**options)

    assert merged_call(make(add), options) == sent[0]
