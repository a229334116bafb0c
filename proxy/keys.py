"""Engram's API keys and its admin token: their format and hashing (pure).

A key reads ``egk_<id>_<secret>``: ``id`` (12 hex digits) is public, shown by ``engram keys
list`` and used to revoke; ``secret`` (32 random bytes, URL-safe base64) is never stored, only
its SHA-256. The secrets are random enough that a fast hash is the right one: there is nothing
to guess from it, and checking a key costs microseconds on the request path.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "egk_"
_KEY = re.compile(r"egk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
KEY_ID = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class NewKey:
    id: str
    secret_hash: str
    key: str  # shown once


def new_key() -> NewKey:
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return NewKey(key_id, hash_secret(secret), f"{PREFIX}{key_id}_{secret}")


def parse_key(text: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed key, else None."""
    m = _KEY.fullmatch(text.strip())
    return (m.group(1), m.group(2)) if m else None


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets (admin token, trusted-proxy secret)."""
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def new_admin_token() -> str:
    return "egadm_" + secrets.token_urlsafe(32)


def credential(headers: Mapping[str, str]) -> str | None:
    """The credential a request carries: ``Authorization: Bearer X`` else ``x-api-key: X``."""
    scheme, _, value = headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = headers.get("X-Api-Key", "").strip()
    return key or None
