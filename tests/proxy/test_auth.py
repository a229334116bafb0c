"""Accounts (auth.mode = keys) and admin access, over real sockets with the fake upstream.

Issue 12, rows 1 and 6: with keys a request's user is its key's user whatever identity header or
body field it sends; the upstream never sees Engram's key; the admin API needs the admin token
(a 0600 file beside the database) or a key, and a user's key sees that user only; the Host check
is never off.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.auth import Authenticator, admin_token_path
from proxy.cli.main import main as engram_main
from proxy.config import AuthSettings
from proxy.services import SERVICES
from proxy.store.store import Store
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

API = "/engram/api"
SECRET = "front-end-secret-0123456789abcdef0123"
IDENTITY_TRIES: list[tuple[dict[str, str], dict[str, Any]]] = [
    ({"X-Engram-User": "alice"}, {}),
    ({"X-OpenWebUI-User-Id": "alice"}, {}),
    ({}, {"user": "alice"}),
    ({}, {"safety_identifier": "alice"}),
    ({"X-Engram-User": "alice", "X-OpenWebUI-User-Id": "alice"}, {"user": "alice"}),
]


def db_of(engram: Engram) -> str:
    return f"{engram.tmp.name}/engram.db"


async def cli(*argv: str) -> int:
    """The engram command, on a thread (it runs its own event loop)."""
    return await asyncio.to_thread(engram_main, list(argv))


async def make_key(
    db: str, user: str, capsys: pytest.CaptureFixture[str], admin: bool = False
) -> str:
    argv = ["keys", "create", "--user", user, "--db", db] + (["--admin"] if admin else [])
    assert await cli(*argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("egk_")
    return out[-1]


async def chat(
    http: aiohttp.ClientSession,
    engram: Engram,
    text: str,
    headers: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> aiohttp.ClientResponse:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **(extra or {})}
    async with http.post(engram.base_url + "/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed_engram(fake: FakeUpstream, **auth: Any) -> Engram:
    return await start_engram(
        fake.url,
        auth={"mode": "keys", "loopback_admin": False, **auth},
        retrieval={"top_k": 10},
    )


@pytest.mark.asyncio
async def test_a_key_decides_the_user_whatever_the_request_claims(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """Row 1: alice stores a note; bob, with his own key, claims to be alice every way there is;
    her note never reaches his forwarded prompt, and what he sends is stored as bob's."""
    engram = await keyed_engram(fake)
    try:
        alice, bob = [await make_key(db_of(engram), u, capsys) for u in ("alice", "bob")]
        r = await chat(http, engram, "My locker code is quokka-7731", bearer(alice))
        assert r.status == 200
        await settle(engram)
        for headers, extra in IDENTITY_TRIES:
            fake.requests.clear()
            r = await chat(
                http, engram, "what is the locker code quokka", {**bearer(bob), **headers}, extra
            )
            assert r.status == 200
            forwarded = str(fake.chat_requests()[-1].json()["messages"])
            assert "quokka-7731" not in forwarded, headers
        await settle(engram)
        store = engram.app[SERVICES].store
        assert store is not None
        users = await store.read(
            lambda c: sorted({r[0] for r in c.execute("SELECT user_id FROM sessions")})
        )
        assert users == ["alice", "bob"]
        # alice's own later request does recall it (the note is there to be found).
        fake.requests.clear()
        await chat(http, engram, "what is the locker code quokka", bearer(alice))
        assert "quokka-7731" in str(fake.chat_requests()[-1].json()["messages"])
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_requests_without_a_working_key_get_401_and_reach_nothing(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    engram = await keyed_engram(fake)
    try:
        key = await make_key(db_of(engram), "alice", capsys)
        key_id = key.split("_")[1]
        wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        for headers in (
            {},
            {"X-Engram-User": "alice"},
            bearer("sk-no-key-required"),
            bearer(wrong_secret),
            {"x-api-key": "egk_000000000000_" + "A" * 43},
        ):
            r = await chat(http, engram, "hello", headers)
            assert r.status == 401, headers
        async with http.get(engram.url + "/v1/models") as r:  # pass-through routes too
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"
        assert not [r for r in fake.requests if r.path.startswith("/v1")]
        assert (await chat(http, engram, "hello", {"x-api-key": key})).status == 200
        assert await cli("keys", "revoke", key_id, "--db", db_of(engram)) == 0
        await asyncio.sleep(5.1)  # a key's row is cached for at most 5 s
        assert (await chat(http, engram, "hello", bearer(key))).status == 401
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_the_upstream_never_sees_engrams_key(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    for upstream_key in ("", "upstream-key-123"):
        engram = await start_engram(
            fake.url,
            auth={"mode": "keys"},
            upstream={"url": fake.url, "api_key": upstream_key},
        )
        try:
            key = await make_key(db_of(engram), "alice", capsys)
            fake.requests.clear()
            assert (await chat(http, engram, "hi", {**bearer(key), "x-api-key": key})).status == 200
            sent = fake.chat_requests()[-1].headers
            assert "x-api-key" not in sent
            if upstream_key:
                assert sent["Authorization"] == f"Bearer {upstream_key}"
            else:
                assert "Authorization" not in sent
            assert key not in str(dict(sent))
        finally:
            await engram.close()


@pytest.mark.asyncio
async def test_a_trusted_front_end_names_its_users(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await keyed_engram(fake, trusted_proxy_secret=SECRET)
    try:
        r = await chat(
            http, engram, "carol's note", {**bearer(SECRET), "X-OpenWebUI-User-Id": "carol"}
        )
        assert r.status == 200 and r.headers["X-Engram-Session"]
        r = await chat(http, engram, "nobody's note", bearer(SECRET))
        assert r.status == 400
        r = await chat(http, engram, "hi", {**bearer(SECRET[:-1] + "x"), "X-Engram-User": "carol"})
        assert r.status == 401
        await settle(engram)
        store = engram.app[SERVICES].store
        assert store is not None
        users = await store.read(
            lambda c: [r[0] for r in c.execute("SELECT user_id FROM sessions")]
        )
        assert users == ["carol"]
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_admin_api_needs_the_token_even_from_loopback(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Row 6: loopback alone no longer grants admin (a same-host reverse proxy makes everyone
    loopback); the token is generated into a 0600 file the CLI reads."""
    engram = await start_engram(fake.url, auth={"loopback_admin": False})
    try:
        async with http.get(engram.url + API + "/export", params={"user": "alice"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "admin_token_required"
        async with http.get(engram.url + "/engram/metrics") as r:
            assert r.status == 401
        path = admin_token_path(Path(db_of(engram)))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        token = path.read_text().strip()
        async with http.get(engram.url + API + "/sessions", headers=bearer(token + "x")) as r:
            assert r.status == 401
        async with http.get(engram.url + API + "/sessions", headers=bearer(token)) as r:
            assert r.status == 200
        async with http.get(engram.url + "/engram/health") as r:
            assert r.status == 200  # open: it shows no memory
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_the_cli_prints_the_same_admin_token(
    fake: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    engram = await start_engram(fake.url)
    try:
        assert await cli("keys", "admin-token", "--db", db_of(engram)) == 0
        printed = capsys.readouterr().out.strip()
        assert printed == engram.app[SERVICES].auth.admin_token
        assert printed.startswith("egadm_")
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_a_users_key_sees_only_that_users_memory(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    engram = await keyed_engram(fake)
    try:
        alice = await make_key(db_of(engram), "alice", capsys)
        bob = await make_key(db_of(engram), "bob", capsys)
        root = await make_key(db_of(engram), "ops", capsys, admin=True)
        await chat(http, engram, "alice likes kumquats", bearer(alice))
        await chat(http, engram, "bob likes rambutans", bearer(bob))
        await settle(engram)

        async def export(key: str, **params: str) -> tuple[int, str]:
            async with http.get(
                engram.url + API + "/export", params=params, headers=bearer(key)
            ) as r:
                return r.status, await r.text()

        status, text = await export(bob)
        assert status == 200 and "rambutans" in text and "kumquats" not in text
        for claim in ({"user": "alice"},):
            status, text = await export(bob, **claim)
            assert status == 403 and "kumquats" not in text
        async with http.get(
            engram.url + API + "/search",
            params={"q": "kumquats"},
            headers={**bearer(bob), "X-Engram-User": "alice"},
        ) as r:
            assert r.status == 403
        status, text = await export(root, user="alice")
        assert status == 200 and "kumquats" in text
    finally:
        await engram.close()


async def raw_request(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = await reader.read(65536)
    writer.close()
    return data


@pytest.mark.asyncio
async def test_the_host_check_is_never_off(fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
    """Row 6: HTTP/1.0 without a Host header skipped the check; a network bind with no
    allowed_hosts switched it off. Now: a Host is required; a name must be allowed; an IP
    address is fine (a page can rebind only a name)."""
    engram = await start_engram(fake.url, server={"host": "0.0.0.0"})
    try:
        reply = await raw_request(engram.url, b"GET /engram/health HTTP/1.0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.0 400") or reply.startswith(b"HTTP/1.1 400"), reply[:80]
        assert b"host_required" in reply
        for host, ok in (
            ("evil.example", False),
            ("127.0.0.1:1", True),
            ("[::1]", True),
            ("10.1.2.3", True),
        ):
            async with http.get(engram.url + "/engram/health", headers={"Host": host}) as r:
                assert (r.status == 200) is ok, host
    finally:
        await engram.close()


def test_a_network_bind_needs_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "e.db")
    base = ["serve", "--host", "0.0.0.0", "--port", "0", "--db", db, "--allow-remote"]
    env = dict(os.environ)
    try:
        assert engram_main(base) == 2
        err = capsys.readouterr().err
        assert "auth.mode" in err and "engram keys create" in err
        os.environ["ENGRAM_AUTH_MODE"] = "keys"
        assert engram_main(base) == 2
        assert "holds no key" in capsys.readouterr().err
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.asyncio
async def test_key_lookups_are_cached_briefly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "k.db")
    key = await make_key(db, "dora", capsys)
    now = [0.0]
    async with Store(Path(db)) as store:
        auth = Authenticator(AuthSettings(mode="keys"), store, "tok", clock=lambda: now[0])
        assert (await auth.client(bearer(key))).user == "dora"
        assert await cli("keys", "revoke", key.split("_")[1], "--db", db) == 0
        assert (await auth.client(bearer(key))).user == "dora"  # cached
        now[0] += 5.01
        with pytest.raises(Exception, match="revoked"):
            await auth.client(bearer(key))
        admin = await auth.admin(bearer("tok"), "203.0.113.9")
        assert admin.admin and admin.user is None


@pytest.mark.asyncio
async def test_keys_guard_a_pure_proxy_too(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """With memory off the keys still live in the database, and still decide who gets through."""
    engram = await start_engram(fake.url, auth={"mode": "keys"}, memory={"enabled": False})
    try:
        key = await make_key(db_of(engram), "erin", capsys)
        assert (await chat(http, engram, "hi", {})).status == 401
        assert (await chat(http, engram, "hi", bearer(key))).status == 200
        assert "Authorization" not in fake.chat_requests()[-1].headers
    finally:
        await engram.close()
