"""Proving knowledge of a shared token without sending it: HMAC-SHA256 over fresh nonces."""

from __future__ import annotations

import os

NONCE_BYTES = 32


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(token: str, role: bytes, challenge: bytes) -> bytes:
    """What the ``role`` side (b"client" or b"server") answers to ``challenge``."""
    import hashlib
    import hmac  # hmac and hashlib load OpenSSL (3 MiB): only a job with a token pays for it

    return hmac.new(token.encode(), role + b":" + challenge, hashlib.sha256).digest()


def verify(token: str, role: bytes, challenge: bytes, answer: bytes) -> bool:
    import hmac

    return hmac.compare_digest(proof(token, role, challenge), answer)


def derived(token: str, purpose: str) -> str:
    """A key for ``purpose`` that whoever knows ``token`` can compute and nobody else can
    (HMAC-SHA256): it never needs to travel, and knowing it tells nothing of the token."""
    import hashlib
    import hmac

    return hmac.new(
        token.encode(), b"relaunch key: " + purpose.encode(), hashlib.sha256
    ).hexdigest()
