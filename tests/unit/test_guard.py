"""The pure decisions of proxy.guard (who may write cross-site, which bodies are JSON) and the
start-up refusal of origins that would open memory to every page."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_settings
from proxy.guard import (
    Source,
    cors_origin,
    cross_site_error,
    is_json_media_type,
    is_own_origin,
    media_type_error,
    normalise_origins,
    source,
)

OWN = "127.0.0.1:8787"
CONFIGURED = normalise_origins(["http://localhost:3000"])


@pytest.mark.parametrize(
    "value",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON;charset=UTF-8",
        " application/json ",
        "application/vnd.api+json",
        "application/merge-patch+json",
    ],
)
def test_json_media_types(value: str) -> None:
    assert is_json_media_type(value)


@pytest.mark.parametrize(
    "value",
    [
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "text/json",
        "application/jsonx",
        "application/+json",
        "",
    ],
)
def test_not_json_media_types(value: str) -> None:
    assert not is_json_media_type(value)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions", "/engram/api/x"])
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_json_only_routes_refuse_other_bodies(method: str, path: str) -> None:
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        err = media_type_error(method, path, ct, has_body=True)
        assert err is not None and err.status == 415 and err.code == "unsupported_media_type"
        assert "application/json" in err.message and path in err.message
    assert media_type_error(method, path, "application/json", has_body=True) is None


def test_a_request_without_a_body_needs_no_content_type() -> None:
    assert media_type_error("POST", "/engram/api/consolidate", None, has_body=False) is None
    assert (
        media_type_error("POST", "/engram/api/consolidate", "application/octet-stream", False)
        is None
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/chat/completions"),
        ("GET", "/engram/api/search"),
        ("OPTIONS", "/v1/chat/completions"),
    ],
)
def test_other_routes_and_methods_take_any_body(method: str, path: str) -> None:
    assert media_type_error(method, path, "multipart/form-data; boundary=b", True) is None


# --- where a request comes from ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("origin", "site", "expected"),
    [
        (None, None, Source.OWN),  # curl, the SDKs
        (None, "none", Source.OWN),  # typed into the address bar
        ("http://127.0.0.1:8787", "same-origin", Source.OWN),
        ("http://127.0.0.1:8787", None, Source.OWN),  # an older browser, own page
        ("http://127.0.0.1:9999", "same-site", Source.FOREIGN),  # another port: same-site
        ("http://127.0.0.1:9999", None, Source.FOREIGN),
        ("http://evil.example", "cross-site", Source.FOREIGN),
        ("http://evil.example", None, Source.FOREIGN),
        (None, "cross-site", Source.FOREIGN),  # a navigation carries no Origin
        ("null", "cross-site", Source.FOREIGN),  # sandboxed frame
        ("null", None, Source.FOREIGN),
        ("http://localhost:3000", "cross-site", Source.CONFIGURED),
        ("HTTP://LOCALHOST:3000", None, Source.CONFIGURED),
        ("http://localhost:3001", "same-site", Source.FOREIGN),
        ("http://localhost:3000", "same-origin", Source.OWN),  # its own origin first
        ("http://evil.example", "Same-Origin", Source.OWN),  # the browser's word is believed
    ],
)
def test_source(origin: str | None, site: str | None, expected: Source) -> None:
    assert source(origin, site, OWN, CONFIGURED) is expected


def test_null_is_configured_only_literally() -> None:
    assert source("null", "cross-site", OWN, frozenset({"null"})) is Source.CONFIGURED
    assert source("null", "cross-site", OWN, frozenset({"*"})) is Source.CONFIGURED
    assert source("http://x", "cross-site", OWN, frozenset()) is Source.FOREIGN


@pytest.mark.parametrize(
    ("origin", "host", "own"),
    [
        ("http://127.0.0.1:8787", "127.0.0.1:8787", True),
        ("http://localhost:8787", "127.0.0.1:8787", False),
        ("http://127.0.0.1:8788", "127.0.0.1:8787", False),
        ("https://engram.example", "engram.example", True),
        ("http://engram.example", "engram.example", True),
        ("https://engram.example:8443", "engram.example", False),
        ("http://[::1]:8787", "[::1]:8787", True),
        ("null", "127.0.0.1:8787", False),
        ("http://127.0.0.1:8787", None, False),
        ("garbage", "127.0.0.1:8787", False),
        ("http://127.0.0.1:99999", "127.0.0.1:8787", False),
    ],
)
def test_is_own_origin(origin: str, host: str | None, own: bool) -> None:
    assert is_own_origin(origin, host) is own


# --- what each source may do -------------------------------------------------------------------

WRITES = ["POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
ROUTES = ["/v1/chat/completions", "/engram/api/consolidate", "/v1/audio/transcriptions", "/x"]


@pytest.mark.parametrize("path", [*ROUTES, "/engram/health", "/engram/"])
@pytest.mark.parametrize("method", WRITES)
def test_a_foreign_page_writes_nowhere(method: str, path: str) -> None:
    err = cross_site_error(method, path, Source.FOREIGN, "http://evil.example")
    assert err is not None and err.status == 403 and err.code == "cross_site_request"
    assert "http://evil.example" in err.message and "server.cors_origins" in err.message


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_foreign_page_may_read_what_the_browser_hides_from_it_anyway(method: str) -> None:
    for path in ("/v1/models", "/engram/health", "/engram/"):
        assert cross_site_error(method, path, Source.FOREIGN, "http://evil.example") is None
    # ... but never the admin API, which holds the memory itself.
    assert cross_site_error(method, "/engram/api/export", Source.FOREIGN, None) is not None


def test_a_foreign_page_opens_no_websocket() -> None:
    for path in ("/v1/realtime", "/engram/health"):
        assert cross_site_error("GET", path, Source.FOREIGN, "http://x", upgrade=True)
    assert cross_site_error("GET", "/v1/realtime", Source.CONFIGURED, "http://x", True) is None
    assert cross_site_error("GET", "/v1/realtime", Source.OWN, None, upgrade=True) is None


@pytest.mark.parametrize("method", WRITES)
def test_a_configured_origin_writes_to_proxied_routes_only(method: str) -> None:
    for path in ("/v1/chat/completions", "/v1/audio/transcriptions"):
        assert cross_site_error(method, path, Source.CONFIGURED, "http://localhost:3000") is None
    for path in ("/engram/api/consolidate", "/engram/health"):
        assert cross_site_error(method, path, Source.CONFIGURED, "http://localhost:3000")
    assert cross_site_error("GET", "/engram/api/search", Source.CONFIGURED, "http://x")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("method", ["GET", *WRITES])
def test_own_origin_and_non_browsers_are_never_refused(method: str, path: str) -> None:
    assert cross_site_error(method, path, Source.OWN, None) is None


def test_cors_only_for_configured_origins_on_proxied_routes() -> None:
    assert cors_origin("/v1/chat/completions", "http://localhost:3000", CONFIGURED)
    assert cors_origin("/v1/models", "http://LOCALHOST:3000", CONFIGURED) == "http://LOCALHOST:3000"
    assert cors_origin("/v1/models", "http://evil.example", CONFIGURED) is None
    assert cors_origin("/v1/models", None, CONFIGURED) is None
    for path in ("/engram/api/search", "/engram/health", "/engram/", "/engram"):
        assert cors_origin(path, "http://localhost:3000", CONFIGURED) is None
        assert cors_origin(path, "http://x", frozenset({"*"})) is None


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["*", "null"])
def test_an_origin_open_to_every_page_is_refused_while_memory_is_on(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"ENGRAM_SERVER_CORS_ORIGINS": f'["http://a.b", "{value}"]'})
    text = str(info.value)
    assert "server.cors_origins" in text and "memory.enabled" in text and value in text
    # A pure proxy may be open to any page: there is no memory to write into.
    s = load_settings(
        None, None, {"server": {"cors_origins": [value]}, "memory": {"enabled": False}}
    )
    assert s.server.cors_origins == [value]


@pytest.mark.parametrize(
    "value", ["http://localhost:3000/", "localhost:3000", "http://a.b/path", "http://a b", ""]
)
def test_a_malformed_origin_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.cors_origins"):
        load_settings(None, None, {"server": {"cors_origins": [value]}})


def test_well_formed_origins_are_accepted() -> None:
    origins = ["http://localhost:3000", "https://chat.example.com", "http://[::1]:8080"]
    origins.append("chrome-extension://abcdefghijklmnop")
    assert load_settings(None, None, {"server": {"cors_origins": origins}}).server.cors_origins
