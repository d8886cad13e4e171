"""The TLS context HTTP clients verify servers with, one per trust setting.

Its own module, importing neither torch nor the wire codec, so the testbed launcher (which polls
the Fed Server's status and imports no torch) shares it with ``shared.http_client``.
"""
from __future__ import annotations

import functools
import ssl


@functools.lru_cache(maxsize=8)
def tls_context(verify: bool | str = True) -> ssl.SSLContext | bool:
    """One TLS context per trust setting, shared by every client of the process.

    Building a context loads the CA bundle (tens of milliseconds); a testbed agent with 100
    virtual devices would otherwise pay that per device and per server, inside timed rounds.
    ``verify`` is True (system CAs), False (no verification) or a CA bundle path.
    """
    if verify is False:
        return False
    return ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
