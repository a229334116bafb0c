"""Secrets kept out of what Engram shows about itself: settings and URLs (pure).

``engram config`` prints the effective settings with :func:`masked_settings`: a setting whose name
says secret (``admin_token``, ``api_key``, ``trusted_proxy_secret``, any ``…password``, judged by
:func:`proxy.redact.secret_kind`, so settings added later are covered by their names) shows
``********`` when set, and every URL (``slots.redis_url``, ``upstream.url``) shows its password and
secret query parameters masked. ``/engram/health``, start-up logs and ``engram doctor`` show URLs
through :func:`display_url`: no user, password, query or fragment at all.
"""

from __future__ import annotations

from typing import Any

from yarl import URL

from proxy.config import Settings, as_dict
from proxy.redact import redact, secret_kind

HIDDEN = "********"


def is_secret_setting(name: str) -> bool:
    """Whether a setting called ``name`` holds a secret (by its name)."""
    return secret_kind(name) is not None


def display_url(url: str) -> str:
    """``url`` without user, password, query and fragment: what may be shown to anyone."""
    if not url:
        return url
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return redact(url)
    if not parsed.is_absolute():
        return redact(url)
    return str(parsed.with_user(None).with_query(None).with_fragment(None))


def masked_url(url: str) -> str:
    """``url`` with its password and the values of secret-looking query parameters masked (the
    user, host and path stay, so a configuration can still be checked)."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return redact(url)
    if parsed.password:
        parsed = parsed.with_password(HIDDEN)
    if parsed.query and any(is_secret_setting(k) for k in parsed.query):
        parsed = parsed.with_query(
            [(k, HIDDEN if is_secret_setting(k) else v) for k, v in parsed.query.items()]
        )
    return str(parsed)


def _masked(name: str, value: Any) -> Any:
    if isinstance(value, list):
        return [_masked(name, v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if is_secret_setting(name):
        return HIDDEN
    if "://" in value:
        return masked_url(value)
    return value


def masked_settings(settings: Settings) -> dict[str, Any]:
    """The settings as plain data, secrets masked (for ``engram config``)."""
    return {
        section: {key: _masked(key, value) for key, value in values.items()}
        for section, values in as_dict(settings).items()
    }
