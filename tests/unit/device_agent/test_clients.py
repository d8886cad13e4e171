"""The device's HTTP clients translate answers into the runner's terms (no HTTP past them)."""
from __future__ import annotations

import time

import pytest

from device_agent.api import Unreachable
from device_agent.clients import HttpFedClient, domain_error
from shared.errors import Conflict, Failed, Invalid, NotAllowed, NotFound, TooSoon, Unauthenticated
from shared.http_client import ServiceError
from testbed.processes import free_port


@pytest.mark.parametrize("status, kind", [(401, Unauthenticated), (403, NotAllowed), (404, NotFound), (409, Conflict),
                                          (422, Invalid), (413, Invalid), (500, Failed), (503, Failed)])
def test_error_statuses_become_the_servers_domain_errors(status, kind):
    error = domain_error(ServiceError(status, "why", "http://x/v1/run"))
    assert type(error) is kind and "why" in error.detail


def test_a_429_is_too_soon_with_the_answer_s_retry_after():
    error = domain_error(ServiceError(429, "registered 1.0 s ago", "http://x/v1/devices/register", retry_after_s=9.0))
    assert isinstance(error, TooSoon) and error.retry_after_s == 9.0
    assert domain_error(ServiceError(429, "no header")).retry_after_s > 0


def test_a_server_that_is_not_there_is_unreachable():
    client = HttpFedClient(f"http://127.0.0.1:{free_port()}", retries=1)
    with pytest.raises(Unreachable):
        client.run_info()
    client.close()


def test_a_request_delay_comes_before_every_request():
    # An emulated round trip: the client waits before it sends (here, before it finds no server).
    for delay_s, at_least, below in ((0.0, 0.0, 0.25), (0.4, 0.4, 5.0)):
        client = HttpFedClient(f"http://127.0.0.1:{free_port()}", retries=0, request_delay_s=delay_s)
        started = time.monotonic()
        with pytest.raises(Unreachable):
            client.run_info()
        assert at_least <= time.monotonic() - started < below
        client.close()
