"""Secure aggregation as in SecAgg+ (Bell et al., CCS 2020), the protocol Flower implements: the
primitives both sides use (docs/privacy.md, "Secure aggregation").

* ``crypto.py``: X25519 key agreement, the AEAD that carries secret shares, the mask generator;
* ``shamir.py``: Shamir's secret sharing over the prime field of 2**521 - 1;
* ``encoding.py``: the fixed-point encoding modulo 2**64 and its range;
* ``graph.py``: who shares with and masks with whom (SecAgg+'s sparse graph, or the complete one);
* ``masks.py``: the masks per model block, added by a device and removed by the Fed Server;
* ``protocol.py``: the stages of one attempt, a device's side and the Fed Server's.

The HTTP side of the stages is ``device_agent/secure_aggregation.py`` and
``fed_server/secure_stages.py``.
"""
