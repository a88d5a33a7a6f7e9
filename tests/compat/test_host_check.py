"""compat.host_check: every touch point is present on this install, and a missing one refuses the boot by name."""

from __future__ import annotations

import importlib
import inspect

import pytest

from celery_durable.compat import host_check
from celery_durable.compat.host_check import OPTIONAL_TOUCH_POINTS, TOUCH_POINTS, TouchPoint, check_host, missing
from celery_durable.errors import HostIncompatible

#: The release that added each optional touch point: from there on, compat's fallback must not be what runs.
ADDED_IN: dict[str, tuple[str, tuple[int, int]]] = {
    "celery.worker.request.Request._eta_timer_entry": ("celery", (5, 7)),
    "kombu.transport.redis.Channel._maybe_update_queues_expire": ("kombu", (5, 7)),
    "kombu.transport.redis.Channel.create_publish_batch": ("kombu", (5, 7)),
    "kombu.transport.redis.Channel.supports_batch_publish": ("kombu", (5, 7)),
}


def _present(point: TouchPoint) -> bool:
    return not missing((point,))


def _remove(monkeypatch: pytest.MonkeyPatch, point: TouchPoint) -> None:
    """Delete ``point`` wherever it is found, as an upgrade that dropped it would (restored after the test)."""
    obj: object = importlib.import_module(point.module)
    *path, name = point.attribute.split(".")
    for part in path:
        obj = getattr(obj, part)
    owners = [obj] if name in vars(obj) else []
    classes = inspect.getmro(obj) if isinstance(obj, type) else inspect.getmro(type(obj))
    owners += [klass for klass in classes if klass is not obj and name in vars(klass)]
    assert owners, f"{point.name} is defined nowhere"
    for owner in owners:
        monkeypatch.delattr(owner, name)


def test_host_check_missing_is_empty_on_this_install() -> None:
    assert missing() == []


def test_host_check_passes_on_this_install(caplog: pytest.LogCaptureFixture) -> None:
    check_host()
    assert "durable.compat.untested_release" not in caplog.text


def test_installed_host_releases_are_ones_compat_was_tested_on() -> None:
    # An upgrade past host_check.TESTED fails here first: rerun tests/compat, then widen the range.
    assert host_check.untested_releases() == []


@pytest.mark.parametrize("point", TOUCH_POINTS, ids=[point.name for point in TOUCH_POINTS])
def test_host_check_names_exactly_the_touch_point_removed(monkeypatch: pytest.MonkeyPatch, point: TouchPoint) -> None:
    _remove(monkeypatch, point)
    assert [p.name for p in missing()] == [point.name]


def test_check_host_refuses_in_one_line_naming_the_missing_point(monkeypatch: pytest.MonkeyPatch) -> None:
    import kombu.transport.redis

    monkeypatch.delattr(kombu.transport.redis.Channel, "_q_for_pri")
    with pytest.raises(HostIncompatible) as refused:
        check_host()
    message = str(refused.value)
    assert "\n" not in message
    assert "kombu.transport.redis.Channel._q_for_pri" in message
    assert "compat.redis_claim" in message
    assert refused.value.code == "durable.host.incompatible"


@pytest.mark.parametrize("point", OPTIONAL_TOUCH_POINTS, ids=[point.name for point in OPTIONAL_TOUCH_POINTS])
def test_optional_touch_point_is_present_from_the_release_that_added_it(point: TouchPoint) -> None:
    if point.name not in ADDED_IN:
        pytest.fail(f"name the release that added {point.name} in ADDED_IN")
    package, added = ADDED_IN[point.name]
    release = tuple(int(part) for part in host_check.installed_version(package).split(".")[:2])
    # A later release that dropped it would quietly run compat's fallback: fail here instead.
    assert _present(point) is (release >= added), f"{point.name} on {package} {release}"


@pytest.mark.parametrize("point", OPTIONAL_TOUCH_POINTS, ids=[point.name for point in OPTIONAL_TOUCH_POINTS])
def test_host_check_does_not_refuse_without_an_optional_touch_point(monkeypatch: pytest.MonkeyPatch,
                                                                   point: TouchPoint) -> None:
    if _present(point):
        _remove(monkeypatch, point)
    assert missing() == []
    check_host()


def test_host_check_instance_touch_points_are_present_on_this_install() -> None:
    assert host_check.missing_on_instances() == []


@pytest.mark.parametrize("point", host_check.INSTANCE_TOUCH_POINTS,
                         ids=[p.name for p in host_check.INSTANCE_TOUCH_POINTS])
def test_host_check_refuses_a_host_whose_instance_lacks_the_touch_point(monkeypatch: pytest.MonkeyPatch,
                                                                        point: host_check.InstanceTouchPoint) -> None:
    module = importlib.import_module(point.module)
    real = getattr(module, point.factory)

    def without_it(*args: object, **kwargs: object) -> object:
        instance = real(*args, **kwargs)
        executor = getattr(instance, "executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
        delattr(instance, point.attribute)
        return instance

    monkeypatch.setattr(module, point.factory, without_it)
    assert [p.name for p in host_check.missing_on_instances()] == [point.name]
    with pytest.raises(HostIncompatible, match=point.name.replace("(", r"\(").replace(")", r"\)")):
        check_host()
