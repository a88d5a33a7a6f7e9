"""The Host a dashboard request may name: its own address and port, never another name (DNS rebinding)."""

from __future__ import annotations

import socket

import pytest

from celery_durable.cli.dashboard_http import host_served


@pytest.mark.parametrize(("header", "bound", "port"), [
    ("127.0.0.1:5577", "127.0.0.1", 5577),
    ("localhost:5577", "127.0.0.1", 5577),
    ("LocalHost:5577", "127.0.0.1", 5577),
    ("10.1.2.3:5577", "10.1.2.3", 5577),
    ("dash.internal:5577", "dash.internal", 5577),
    ("[::1]:5577", "::1", 5577),
    ("localhost", "127.0.0.1", 80),
    ("192.168.4.7:5577", "0.0.0.0", 5577),
    (f"{socket.gethostname()}:5577", "0.0.0.0", 5577),
])
def test_the_dashboards_own_address_is_served(header, bound, port):
    assert host_served(header, bound, port)


@pytest.mark.parametrize(("header", "bound", "port"), [
    (None, "127.0.0.1", 5577),
    ("", "127.0.0.1", 5577),
    ("evil.example:5577", "127.0.0.1", 5577),
    ("127.0.0.1:5578", "127.0.0.1", 5577),
    ("localhost", "127.0.0.1", 5577),
    ("127.0.0.1.nip.io:5577", "127.0.0.1", 5577),
    ("localhost:5577.evil.example", "127.0.0.1", 5577),
    ("10.1.2.3:5577", "127.0.0.1", 5577),
    ("evil.example:5577", "0.0.0.0", 5577),
    ("192.168.4.7:5578", "0.0.0.0", 5577),
    ("[::1:5577", "::1", 5577),
])
def test_another_name_or_port_is_refused(header, bound, port):
    assert not host_served(header, bound, port)
