"""The cryptography of secure aggregation, from the ``cryptography`` package: X25519 key
pairs and agreement (hashed with HKDF-SHA256 into a 32-byte key), ChaCha20-Poly1305 for the secret
shares a device sends its neighbours through the Fed Server, and ChaCha20's keystream as the
generator of the masks; and SHA-256 (``hashlib``) for the commitments that let the Fed Server check
a share or a rebuilt secret against what its owner dealt. Flower's masks come from NumPy's Mersenne Twister seeded with 32 bits of
the agreed key; a keystream keyed with all 256 bits cannot be guessed from a few words of it."""
from __future__ import annotations

import hashlib
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: What each agreed key is for (HKDF's ``info``): one agreement never serves two purposes.
MASK_PURPOSE = b"s2fl secagg pairwise mask"
SHARE_PURPOSE = b"s2fl secagg share encryption"
SEED_PURPOSE = b"s2fl secagg self mask"
NONCE_BYTES = 12
#: ChaCha20-Poly1305's tag, after the ciphertext.
TAG_BYTES = 16
#: A commitment's length: SHA-256 cut to 128 bits, as hard to match as the 16-byte seed to guess.
DIGEST_BYTES = 16


class ShareError(ValueError):
    """What a device refuses in secure aggregation's stages: a secret share that does not decrypt
    or verify, a public key that agrees on nothing, a roster or question that would expose its
    update (repeated keys, its own keys misstated, fewer devices than the threshold)."""


def new_private_key() -> bytes:
    """A fresh X25519 private key, raw (32 bytes)."""
    return X25519PrivateKey.generate().private_bytes_raw()


def private_key(private: bytes | X25519PrivateKey) -> X25519PrivateKey:
    """The key object of a private key, raw or built already. Building one derives the public
    key, as long as an agreement: a party that agrees with many peers builds it once
    (:func:`agree` and :func:`public_key` take either)."""
    return private if isinstance(private, X25519PrivateKey) else X25519PrivateKey.from_private_bytes(private)


def public_key(private: bytes | X25519PrivateKey) -> bytes:
    """The raw public key (32 bytes) of a private key."""
    return private_key(private).public_key().public_bytes_raw()


def agree(private: bytes | X25519PrivateKey, peer_public: bytes, purpose: bytes) -> bytes:
    """The 32-byte key two devices agree on for ``purpose``: X25519 of one's private key and the
    other's public key, through HKDF-SHA256. ShareError for a public key of low order (an
    agreement on zero), which ``cryptography`` refuses."""
    try:
        shared = private_key(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise ShareError(f"the public key agrees on nothing: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(shared)


#: What :func:`check_public_key` agrees with: any key tells a low-order point, and no agreement
#: with it is ever used.
_CHECKER = X25519PrivateKey.generate()


def check_public_key(peer_public: bytes) -> None:
    """ShareError unless ``peer_public`` is a key an agreement can use."""
    agree(_CHECKER, peer_public, b"check")


def seed_key(seed: bytes) -> bytes:
    """The 32-byte key of a device's own mask from its 16-byte seed."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SEED_PURPOSE).derive(seed)


def share_context(run_id: str, round_id: int) -> bytes:
    """What binds a secret share to its run and attempt."""
    return f"{run_id}|{round_id}".encode()


def share_associated(run_id: str, round_id: int, sender: str, recipient: str) -> bytes:
    """The associated data a secret share is sealed with: its attempt, its sender and recipient."""
    return share_context(run_id, round_id) + f"|{sender}|{recipient}".encode()


def commitment(run_id: str, round_id: int, owner: str, what: str, value: bytes) -> bytes:
    """:data:`DIGEST_BYTES` bytes of SHA-256 committing ``owner``, in its attempt, to ``value``
    (``what`` names it: its seed, or the share of its seed or mask key it dealt a neighbour). A
    secret or share has at least 128 bits the Fed Server does not know even with ``threshold - 1``
    other shares, so the commitment gives it no more than the 16-byte seed does; what it gives is a
    check: no other value matches it."""
    return hashlib.sha256(share_context(run_id, round_id) + f"|{owner}|{what}|".encode() + value).digest()[:DIGEST_BYTES]


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 of ``plaintext`` bound to ``associated`` (sender, recipient, attempt): a
    random nonce, then the ciphertext and its tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`seal`; ShareError when it was altered, sealed for another
    ``associated`` or with another key."""
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise ShareError("does not decrypt with the agreed key (altered, or sealed for someone else)") from None


def keystream_words(key: bytes, stream: int, count: int) -> np.ndarray:
    """``count`` uniformly random 64-bit words (uint64): ChaCha20's keystream under ``key``, the
    ``stream``-th of the key's independent streams (its nonce)."""
    nonce = (0).to_bytes(4, "little") + stream.to_bytes(12, "little")
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * count)), dtype="<u8")
