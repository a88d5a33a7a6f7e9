"""compat.transport_alias: ``durable+postgresql://…`` resolves through kombu's own transport table."""

from __future__ import annotations

import pytest
from kombu import Connection, transport

from celery_durable.broker import TRANSPORT_ALIAS, TRANSPORT_PATH, register
from celery_durable.broker.transport import Transport
from celery_durable.compat.transport_alias import register_transport_alias

ALIAS = "durable-compat-test"


@pytest.fixture(autouse=True)
def restored_transport_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "TRANSPORT_ALIASES", dict(transport.TRANSPORT_ALIASES))


def test_kombu_resolves_a_registered_alias_to_the_transport_class() -> None:
    register_transport_alias(ALIAS, TRANSPORT_PATH)
    assert transport.resolve_transport(ALIAS) is Transport


def test_kombu_splits_alias_plus_url_at_the_first_plus_and_hands_the_rest_as_hostname() -> None:
    register()
    conn = Connection(f"{TRANSPORT_ALIAS}+postgresql+psycopg2://app:secret@db:5433/app?options=x")
    assert conn.transport_cls == TRANSPORT_ALIAS
    assert conn.hostname == "postgresql+psycopg2://app:secret@db:5433/app?options=x"
    assert conn.get_transport_cls() is Transport
    # What Celery shows in its banner: the URL as given, with the password masked.
    assert conn.as_uri().startswith(f"{TRANSPORT_ALIAS}+postgresql+psycopg2://app:**@db")


def test_an_unregistered_alias_is_refused_by_kombu() -> None:
    with pytest.raises(KeyError):
        transport.resolve_transport(ALIAS)


def test_install_registers_the_durable_alias() -> None:
    from celery import Celery

    import celery_durable

    transport.TRANSPORT_ALIASES.pop(TRANSPORT_ALIAS, None)
    celery_durable.install(Celery("t", broker="durable+postgresql://app@db/app", set_as_current=False))
    assert transport.resolve_transport(TRANSPORT_ALIAS) is Transport
