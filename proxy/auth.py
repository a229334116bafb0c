"""Who is asking: Engram's keys, the trusted front-end, and the admin token.

    proxied requests   auth.mode = "none": anyone who reaches the port (loopback only); the
                       user comes from identity headers or the client's key (proxy.chat.identity)
                       auth.mode = "keys": ``Authorization: Bearer <key>`` or ``x-api-key``; the
                       user is the key's and nothing in the request changes it, except for a
                       front-end that presents ``auth.trusted_proxy_secret`` as its key: its
                       identity headers name the user
    the admin API      the admin token (``memory.admin_token``, else generated into a 0600 file
                       beside the database); with keys, an admin key (any ``?user=``) or a
                       user's key (that user only); loopback without a token only when
                       ``auth.loopback_admin`` is on (and mode is none)

A key's row is cached for :data:`KEY_CACHE_SECONDS`, so a revoked key stops working within
that time in every running server (``engram keys revoke`` runs in another process).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from proxy.cache import LRU
from proxy.chat.identity import identify
from proxy.config import AuthSettings
from proxy.errors import Forbidden, Unauthorized
from proxy.keys import credential, new_admin_token, parse_key, same_secret, secret_matches
from proxy.store.keys import KeyRow, find_key
from proxy.store.store import Store

log = logging.getLogger("engram.auth")

KEY_CACHE_SECONDS = 5.0
CREATE_KEY_HINT = (
    "create one with `engram keys create --user NAME` (same --db / --config as the server)"
)


@dataclass(frozen=True)
class Principal:
    """The party a request comes from."""

    user: str | None  # the credential's user; None: the request names its user
    admin: bool
    via: str  # none | key | trusted-proxy | admin-token | loopback
    key_id: str | None = None


ANONYMOUS = Principal(None, False, "none")
PRINCIPAL = web.RequestKey("principal", Principal)  # set on each request by the middleware


def acting_user(principal: Principal, named: str | None) -> str:
    """The user namespace ``principal`` acts on when a request names ``named`` (the admin API,
    the inspector): the admin token and admin keys choose it (else the key's own user, else
    ``default``); a user's key acts on its own user only, and naming another is a 403."""
    if principal.admin:
        return clean_user(named) if named else (principal.user or clean_user(None))
    assert principal.user is not None
    if named and clean_user(named) != principal.user:
        raise Forbidden(
            f"This key belongs to user {principal.user!r}: it cannot act on another user's "
            "memory (only admin keys and the admin token choose the user).",
            code="not_your_user",
        )
    return principal.user


def clean_user(raw: str | None) -> str:
    """A user namespace as the chat pipeline names it (``default`` when absent)."""
    return identify({"X-Engram-User": raw} if raw else {}, {}).user


def is_loopback_peer(remote: str | None) -> bool:
    """Whether a peer address is a loopback one (IPv4-mapped IPv6 included)."""
    if not remote:
        return False
    try:
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


class Authenticator:
    """Decides the :class:`Principal` of proxied and admin requests."""

    def __init__(
        self,
        settings: AuthSettings,
        store: Store | None,
        admin_token: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.admin_token = admin_token
        self._clock = clock
        self._cache: LRU[str, tuple[float, KeyRow | None]] = LRU(4096)

    @property
    def keys(self) -> bool:
        return self.settings.mode == "keys"

    async def client(self, headers: Mapping[str, str]) -> Principal:
        """The principal of a proxied request (chat completions, pass-through)."""
        if not self.keys:
            return ANONYMOUS
        given = credential(headers)
        if given is None:
            raise Unauthorized(
                "Engram needs an API key (auth.mode = keys): send Authorization: Bearer <key> "
                f"or x-api-key: <key>; {CREATE_KEY_HINT}.",
                code="missing_api_key",
            )
        if same_secret(given, self.settings.trusted_proxy_secret):
            return Principal(None, False, "trusted-proxy")
        row = await self._key(given)
        if row is None:
            raise Unauthorized(
                "Invalid or revoked Engram API key (auth.mode = keys).", code="invalid_api_key"
            )
        return Principal(row.user_id, row.admin, "key", row.id)

    async def admin(self, headers: Mapping[str, str], remote: str | None) -> Principal:
        """The principal of an admin API request; 401 when it may not use the admin API."""
        given = credential(headers)
        if given is not None:
            if same_secret(given, self.admin_token):
                return Principal(None, True, "admin-token")
            row = await self._key(given) if self.keys else None
            if row is not None:
                return Principal(row.user_id, row.admin, "key", row.id)
        if not self.keys and self.settings.loopback_admin and is_loopback_peer(remote):
            return Principal(None, True, "loopback")
        keys = " or an Engram key" if self.keys else ""
        raise Unauthorized(
            f"The admin API needs Authorization: Bearer <admin token>{keys}; "
            "`engram keys admin-token` prints the token.",
            code="invalid_admin_token" if given is not None else "admin_token_required",
        )

    async def key_active(self, key_id: str) -> bool:
        """Whether the key of this id still works (not revoked, not deleted): a sign-in made
        with a key ends when the key does (within :data:`KEY_CACHE_SECONDS`)."""
        row = await self._row(key_id)
        return row is not None and row.revoked_at is None

    async def _row(self, key_id: str) -> KeyRow | None:
        """The stored row of a key id, kept :data:`KEY_CACHE_SECONDS`."""
        if self.store is None:
            return None
        now = self._clock()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[0] < KEY_CACHE_SECONDS:
            return cached[1]
        row = await self.store.read(lambda c: find_key(c, key_id))
        self._cache[key_id] = (now, row)
        return row

    async def _key(self, given: str) -> KeyRow | None:
        """The working key ``given`` is, or None (unknown, revoked, wrong secret)."""
        parsed = parse_key(given)
        if parsed is None:
            return None
        key_id, secret = parsed
        row = await self._row(key_id)
        if row is None or row.revoked_at is not None or not secret_matches(secret, row.secret_hash):
            return None
        return row


# --- the admin token file -----------------------------------------------------------------------


def admin_token_path(db: Path) -> Path:
    """Where the generated admin token of the database ``db`` lives."""
    return db.with_name(db.name + ".admin-token")


def load_admin_token(configured: str, db: Path, create: bool = True) -> str:
    """``memory.admin_token`` when set; else the token in the file beside ``db``, made (0600)
    when missing and ``create``. Empty when there is none and ``create`` is off."""
    if configured:
        return configured
    path = admin_token_path(db)
    token = _read_token(path)
    if token or not create:
        return token
    token = new_admin_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return _read_token(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("admin token generated into %s", path)
    return token


def _read_token(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return ""
    if path.stat().st_mode & 0o077:
        log.warning("%s is readable by other users; making it 0600", path)
        path.chmod(0o600)
    return text
