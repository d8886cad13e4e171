"""The Main Server's one call out: a finished group's server portion to the Fed Server, over HTTP.

Apart from :class:`~main_server.server.MainServer`, which builds the portion and hands it to
whatever sends it (the app gives it :meth:`FedServerPortions.send`), so the round logic knows
nothing of HTTP and a test can take the portions without a Fed Server.
"""
from __future__ import annotations

import httpx

from shared.auth import FED_SERVER, Auth
from shared.http_client import ServiceError, decode_response, post_body, service_client, service_signer
from shared.retry import Backoff, retry_async
from shared.schemas import API, Ack, ServerPortionUpload
from shared.wire import pack_body

# What another try of a portion upload may get past: no answer (the Fed Server restarting, a
# network fault) or a server error. A refusal (:class:`PortionRefused`) is final.
_UPLOAD_RETRY_ON = (httpx.HTTPError, ServiceError)


class PortionRefused(Exception):
    """The Fed Server refused a group's portion (a 4xx answer): sent again, it would be again."""


class FedServerPortions:
    """POSTs portions to the Fed Server at ``fed_server_url`` with the service credentials of
    ``auth`` (``ca_file``: the CA bundle to verify its HTTPS certificate), up to ``retries`` tries."""

    def __init__(self, fed_server_url: str, auth: Auth, ca_file: str | None, retries: int) -> None:
        self.fed_server_url = fed_server_url.rstrip("/")
        self.auth = auth
        self.ca_file = ca_file
        self.retries = retries

    async def send(self, upload: ServerPortionUpload) -> int:
        """Send ``upload``, trying again with backoff when the Fed Server did not answer or answered
        a server error (it may be restarting); the body's bytes. The last try's failure, or a
        refusal (:class:`PortionRefused`: the same portion would be refused again), is raised."""
        body = pack_body(upload.model_dump())
        url = f"{self.fed_server_url}{API}/rounds/{upload.round_id}/server-portions"
        async with service_client(service_signer(self.auth, FED_SERVER), self.ca_file, timeout=60.0) as client:
            async def post() -> Ack:
                try:
                    return decode_response(await post_body(client, url, body), Ack)
                except ServiceError as exc:
                    if exc.status < 500:
                        raise PortionRefused(str(exc)) from None
                    raise
            await retry_async(post, Backoff(self.retries, first_delay_s=0.5), _UPLOAD_RETRY_ON,
                              f"round {upload.round_id} group {upload.group_id} upload")
        return len(body)
