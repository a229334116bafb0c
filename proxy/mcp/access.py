"""Who an MCP request acts for: the chat routes' rules, plus the admin token.

    Authorization: Bearer <admin token>   admin: acts for the user a tool's ``user`` argument
                                          names, else X-Engram-User, else ``default``
    auth.mode = "keys"                    an Engram key is required (401 without one, or with a
                                          wrong or revoked one) and decides the user, as on the
                                          chat routes; an admin key may name the user like the
                                          admin token (default: its own user); a trusted
                                          front-end's secret needs X-OpenWebUI-User-Id or
                                          X-Engram-User (400 without)
    auth.mode = "none"                    anyone who reaches the port (Engram then binds
                                          loopback only); the user from the identity headers,
                                          else a hash of the client's API key, else ``default``
                                          (:func:`proxy.chat.identity.identify`)

A 401 is a plain JSON error: no ``WWW-Authenticate`` and no OAuth discovery, so clients keep
sending the bearer header they were configured with (:mod:`proxy.mcp.http`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.api.views import clean_user
from proxy.auth import Authenticator, Principal
from proxy.chat.identity import identify
from proxy.errors import BadRequest
from proxy.keys import credential, same_secret


@dataclass(frozen=True)
class Access:
    """What a request's credential lets the tools do: act for ``user``, or (``may_name_user``)
    for the user a ``user`` argument names."""

    user: str
    may_name_user: bool

    def acting_for(self, named: str | None) -> str:
        """The user a tool call acts for (``named`` reaches here only where allowed: the
        ``user`` argument exists only in an admin's schemas)."""
        if named is None or not self.may_name_user:
            return self.user
        return clean_user(named)


async def principal(auth: Authenticator, headers: Mapping[str, str]) -> Principal:
    """The :class:`~proxy.auth.Principal` of an MCP request: the admin token's, else the chat
    routes' (:meth:`~proxy.auth.Authenticator.client`: a 401 where a key is required)."""
    given = credential(headers)
    if given is not None and same_secret(given, auth.admin_token):
        return Principal(None, True, "admin-token")
    return await auth.client(headers)


def access_of(who: Principal, headers: Mapping[str, str]) -> Access:
    """What ``who`` may do (module docstring); a 400 for a trusted front-end naming no user."""
    if who.admin:
        named = headers.get("X-Engram-User")
        return Access(clean_user(named) if named else (who.user or clean_user(None)), True)
    if who.user is not None:
        return Access(who.user, False)
    ident = identify(headers, {})
    if who.via == "trusted-proxy" and ident.user_source != "header":
        raise BadRequest(
            "A trusted front-end (auth.trusted_proxy_secret) must name the user: send "
            "X-OpenWebUI-User-Id or X-Engram-User.",
            code="user_required",
        )
    return Access(ident.user, False)
