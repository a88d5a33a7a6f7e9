"""The beat lease's holder token names the leader's host and pid, fits the column, and old tokens stay readable."""

from __future__ import annotations

import os
import socket

import pytest

from celery_durable.beat.holder import HOLDER_CHARS, HolderParts, holder_parts, new_holder


def test_a_new_token_names_this_host_and_process():
    token = new_holder()
    parts = holder_parts(token)
    assert parts is not None and parts.pid == os.getpid() and parts.host
    assert socket.gethostname().startswith(parts.host) and len(token) <= HOLDER_CHARS


def test_two_tokens_of_one_process_differ():
    # A replica SIGHUP restarts in place keeps its pid; containers on one host network share pid 1.
    assert new_holder("h", 1) != new_holder("h", 1)


def test_a_long_host_name_is_cut_so_the_token_fits_the_column_and_the_pid_survives():
    token = new_holder("x" * 300 + ".example", 4194304)
    assert len(token) == HOLDER_CHARS
    parts = holder_parts(token)
    assert parts is not None and parts.pid == 4194304 and parts.host == "x" * (HOLDER_CHARS - len(":4194304:") - 12)


def test_a_host_name_with_colons_is_kept_whole():
    assert holder_parts(new_holder("fe80::1", 7)) == HolderParts("fe80::1", 7)


@pytest.mark.parametrize("token", ["6f1d3b1e5b7c4d4e9a572c0c2f0b7a61", "", "host:12", "host:pid:0123456789ab",
                                   ":12:0123456789ab", "host:12:0123456789aZ", "host:12:0123456789a"])
def test_a_token_that_names_no_host_and_pid_reads_as_none(token):
    # uuid hex: what replicas wrote before tokens named their host (a lease an older replica holds).
    assert holder_parts(token) is None
