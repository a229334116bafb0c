"""Sessions keyed by owner (issue 12, row 5 and the session part of row 12): a session id is a
name within its user's namespace; no id chosen in another namespace captures a turn, a sub-agent
never writes into its parent by naming it, reserved names cannot be taken, and the admin API
shows and finds a session by the id its owner's client uses."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import aiohttp
import pytest

from proxy.background.consolidation import facts_session
from proxy.services import SERVICES
from proxy.store.models import Turn
from proxy.store.naming import named_session
from testing.harness import Engram, settle

pytestmark = pytest.mark.asyncio


def h8(user: str) -> str:
    """The suffix an older Engram gave a user's copy of a taken session id."""
    return hashlib.sha256(user.encode()).hexdigest()[:8]


async def chat(
    http: aiohttp.ClientSession,
    engram: Engram,
    user: str,
    text: str,
    history: list[dict[str, Any]] | None = None,
    **headers: str,
) -> aiohttp.ClientResponse:
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": user, **headers},
        json={"model": "m", "messages": [*(history or []), {"role": "user", "content": text}]},
    ) as r:
        await r.read()
        return r


async def user_turns(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for s in await store.list_sessions(user):
        out += await store.session_turns(s.id)
    return out


async def api(http: aiohttp.ClientSession, engram: Engram, path: str, user: str) -> tuple[int, Any]:
    async with http.get(engram.url + "/engram/api" + path, headers={"X-Engram-User": user}) as r:
        return r.status, await r.json()


async def test_no_id_in_another_namespace_captures_a_turn(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """bob owns ``project``; mallory pre-creates the ids alice's ``project`` could be stored
    under; alice's turn stays hers and mallory's search never finds it."""
    assert (await chat(http, engram, "bob", "bob's plans", **{"X-Engram-Session": "project"})).ok
    digest = hashlib.sha256(b"5:alice\0project").hexdigest()[:16]  # naming.free_session_id
    for squat in (f"project~{h8('alice')}", f"project~{digest}"):
        r = await chat(http, engram, "mallory", "trap", **{"X-Engram-Session": squat})
        assert r.headers["X-Engram-Session"] == squat
    r = await chat(
        http, engram, "alice", "alice's secret zebra code", **{"X-Engram-Session": "project"}
    )
    assert r.status == 200
    await settle(engram)
    assert "zebra" not in " ".join(t.content for t in await user_turns(engram, "mallory"))
    assert [t.content for t in await user_turns(engram, "alice") if t.role == "user"] == [
        "alice's secret zebra code"
    ]
    assert r.headers["X-Engram-Session"] == "project"  # her own id, as she sent it
    assert "zebra" not in " ".join(t.content for t in await user_turns(engram, "bob"))
    status, found = await api(http, engram, "/search?q=zebra+code&mode=fts", "mallory")
    assert status == 200 and found["results"] == []
    status, found = await api(http, engram, "/search?q=zebra+code&mode=fts", "alice")
    assert {r["session"] for r in found["results"]} == {"project"}
    # Each user's admin API shows and finds its own "project" by that id.
    for user, text in (("alice", "alice's secret zebra code"), ("bob", "bob's plans")):
        status, detail = await api(http, engram, "/sessions/project", user)
        assert status == 200 and detail["session"]["id"] == "project"
        assert [t["content"] for t in detail["turns"] if t["role"] == "user"] == [text]
        status, listing = await api(http, engram, "/sessions", user)
        assert [s["id"] for s in listing["sessions"]] == ["project"]


async def test_subagent_naming_its_parent_gets_its_own_child(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    assert (await chat(http, engram, "alice", "main task", **{"X-Engram-Session": "main"})).ok
    await settle(engram)
    store = engram.app[SERVICES].store
    main = await store.read(lambda c: named_session(c, "alice", "main"))
    assert main is not None
    before = [t.content for t in await store.session_turns(main.id)]
    sub = {"X-Engram-Session": "main", "X-Engram-Parent": "main", "X-Engram-Agent": "helper"}
    r = await chat(http, engram, "alice", "sub-agent step one", **sub)
    assert r.status == 200
    child_name = r.headers["X-Engram-Session"]
    assert child_name != "main"
    history = [
        {"role": "user", "content": "sub-agent step one"},
        {"role": "assistant", "content": "echo: sub-agent step one"},  # the fake's reply
    ]
    await settle(engram)
    r2 = await chat(http, engram, "alice", "sub-agent step two", history, **sub)
    assert r2.headers["X-Engram-Session"] == child_name  # continued, still its own
    await settle(engram)
    assert [t.content for t in await store.session_turns(main.id)] == before
    child = await store.read(lambda c: named_session(c, "alice", child_name))
    assert child is not None and child.parent_id == main.id and child.level == 1
    contents = [t.content for t in await store.session_turns(child.id) if t.role == "user"]
    assert contents == ["sub-agent step one", "sub-agent step two"]


async def test_parent_is_a_name_of_the_same_user(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """bob owns ``plan`` and alice has her own ``plan``: her sub-agent links to hers; a parent
    only another user has is a 404."""
    assert (await chat(http, engram, "bob", "bob", **{"X-Engram-Session": "plan"})).ok
    assert (await chat(http, engram, "bob", "bob", **{"X-Engram-Session": "bobs-only"})).ok
    assert (await chat(http, engram, "alice", "alice", **{"X-Engram-Session": "plan"})).ok
    r = await chat(http, engram, "alice", "sub", **{"X-Engram-Parent": "plan"})
    assert r.status == 200
    await settle(engram)
    store = engram.app[SERVICES].store
    child = await store.read(lambda c: named_session(c, "alice", r.headers["X-Engram-Session"]))
    mine = await store.read(lambda c: named_session(c, "alice", "plan"))
    assert child is not None and mine is not None and child.parent_id == mine.id
    r = await chat(http, engram, "alice", "sub", **{"X-Engram-Parent": "bobs-only"})
    assert r.status == 404
    assert (await store.list_sessions("alice")) and len(await store.list_sessions("bob")) == 2


async def test_reserved_names_cannot_be_taken(engram: Engram, http: aiohttp.ClientSession) -> None:
    """``facts~<user>`` is consolidation's: a client sending it (or the older fallback name)
    gets another session, and alice's facts session is made and found as ever."""
    for name in ("facts~alice", f"facts~alice~{h8('alice')}"):
        r = await chat(http, engram, "mallory", "squat", **{"X-Engram-Session": name})
        assert r.status == 200
    await settle(engram)
    store = engram.app[SERVICES].store
    sid = await store.write(lambda c: facts_session(c, "alice", time.time()))
    r = await chat(http, engram, "alice", "mine?", **{"X-Engram-Session": "facts~alice"})
    assert r.headers["X-Engram-Session"].startswith("h-")  # not the reserved name
    await settle(engram)
    facts = await store.get_session(sid)
    assert facts is not None and facts.user_id == "alice" and facts.name == "facts~alice"
    assert await store.session_turns(sid) == []  # no client turn was written into it
    assert await store.write(lambda c: facts_session(c, "alice", time.time())) == sid
    assert not any(s.name.startswith("facts~") for s in await store.list_sessions("mallory"))
