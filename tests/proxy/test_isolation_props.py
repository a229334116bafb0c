"""Property-based isolation: random trees of users, sessions and sub-agents; random writes and
searches through the proxy and the admin API; nothing ever crosses a boundary.

Each example builds a fresh forest (1-2 users, each with 1-2 top-level sessions, each with 0-2
sub-agents, each of those with 0-1 sub-sub-agent: depth <= 2) under names unique to the example,
in one Engram app shared by all examples. Every session writes one or two chat turns holding its
own marker word (through an explicit ``X-Engram-Session`` or recognised by its fingerprint), then
every session, and a fresh sub-agent and a fresh top-level conversation, asks a read-only question
naming every marker of the example. Visible to a top-level conversation: the turns of its user's
top-level sessions; to a sub-agent: its own session's turns only; to anyone: never another user's.
What the upstream receives, and what the admin API answers, is checked against that, both ways:
nothing invisible shows up, and (top-level) everything visible does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, start_engram

MARKER = re.compile(r"zq\d+x\d+zq")
EXAMPLES = 100


@dataclass
class Node:
    key: int
    user: int
    parent: int | None
    level: int
    explicit: bool
    writes: int
    sid: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


@st.composite
def forests(draw: st.DrawFn) -> list[Node]:
    nodes: list[Node] = []

    def add(user: int, parent: int | None, level: int) -> int:
        nodes.append(
            Node(len(nodes), user, parent, level, draw(st.booleans()), draw(st.integers(1, 2)))
        )
        return len(nodes) - 1

    for user in range(draw(st.integers(1, 2))):
        for _ in range(draw(st.integers(1, 2))):
            top = add(user, None, 0)
            for _ in range(draw(st.integers(0, 2))):
                kid = add(user, top, 1)
                for _ in range(draw(st.integers(0, 1))):
                    add(user, kid, 2)
    order = draw(st.permutations(range(len(nodes))))  # write order (parents still first)
    return [nodes[i] for i in order]


@dataclass
class World:
    """What one example built, and what each session may see."""

    ex: int
    nodes: list[Node]

    def node(self, key: int) -> Node:
        return next(n for n in self.nodes if n.key == key)

    def user(self, node: Node) -> str:
        return f"u{self.ex}-{node.user}"

    def marker(self, node: Node) -> str:
        return f"zq{self.ex}x{node.key}zq"

    def markers(self, nodes: Iterator[Node] | list[Node]) -> set[str]:
        return {self.marker(n) for n in nodes}

    def visible_to(self, node: Node | None, user: int, subagent: bool) -> set[str]:
        """Markers a request may be given: a sub-agent its own session's; a top-level
        conversation those of its user's top-level sessions."""
        if subagent:
            return self.markers([node]) if node is not None else set()
        return self.markers(n for n in self.nodes if n.user == user and n.parent is None)


class Harness:
    def __init__(self, engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
        self.engram = engram
        self.fake = fake
        self.http = http
        self.examples = 0
        self.requests = 0
        self.probes = 0
        self.api_calls = 0

    async def settle(self) -> None:
        tasks = self.engram.app[SERVICES].tasks
        for _ in range(1000):
            if not len(tasks):
                return
            await asyncio.sleep(0.005)
        raise AssertionError("background work did not finish")

    async def chat(
        self, headers: dict[str, str], messages: list[dict[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        self.requests += 1
        async with self.http.post(
            self.engram.url + "/v1/chat/completions", headers=headers, json={"messages": messages}
        ) as r:
            assert r.status == 200, await r.text()
            return r.headers.get("X-Engram-Session", ""), (await r.json())["choices"][0]["message"]

    async def api(self, path: str, user: str, **params: str) -> tuple[int, Any]:
        self.api_calls += 1
        async with self.http.get(
            f"{self.engram.url}/engram/api/{path}",
            headers={"X-Engram-User": user},
            params=params,
        ) as r:
            text = await r.text()
            if path == "export" and r.status == 200:
                return r.status, [json.loads(line) for line in text.splitlines() if line]
            return r.status, json.loads(text) if text else None

    def headers(self, w: World, node: Node) -> dict[str, str]:
        h = {"X-Engram-User": w.user(node)}
        if node.explicit:
            h["X-Engram-Session"] = f"s{w.ex}-{node.key}"
        if node.parent is not None:
            h["X-Engram-Parent"] = w.node(node.parent).sid
            h["X-Engram-Agent"] = f"agent{node.key}"
        return h

    async def write(self, w: World, node: Node, n: int) -> None:
        msg = {"role": "user", "content": f"note {n} of {w.marker(node)} for later"}
        messages = [msg] if node.explicit else [*node.history, msg]
        sid, reply = await self.chat(self.headers(w, node), messages)
        if node.sid:
            assert sid == node.sid, "a conversation continued in another session"
        node.sid = sid
        node.history += [msg, reply]

    async def probe(
        self, w: World, headers: dict[str, str], history: list[dict[str, Any]]
    ) -> set[str]:
        """The markers Engram injected into a read-only question naming every marker."""
        self.probes += 1
        nonce = f"probe{self.probes}"
        question = f"{nonce} recall " + " ".join(sorted(w.markers(w.nodes)))
        await self.chat(
            {**headers, "X-Engram-Memory": "read-only"},
            [*history, {"role": "user", "content": question}],
        )
        (sent,) = [
            r.json()
            for r in self.fake.chat_requests()
            if nonce in json.dumps(r.json()["messages"][-1])
        ]
        injected = forwarded_memory(sent["messages"])  # every block, wherever it is laid
        return set(MARKER.findall(injected))

    async def run(self, nodes: list[Node]) -> None:
        self.examples += 1
        w = World(self.examples, nodes)
        for n in (1, 2):  # parents first, so sub-agents can name them
            for node in sorted(nodes, key=lambda x: x.level):
                if node.writes >= n:
                    await self.write(w, node, n)
            await self.settle()
        for node in nodes:
            await self.check_proxy(w, node)
        for user in {n.user for n in nodes}:
            await self.check_fresh(w, user)
            await self.check_api(w, user)

    async def check_proxy(self, w: World, node: Node) -> None:
        headers = self.headers(w, node)
        got = await self.probe(w, headers, [] if node.explicit else node.history)
        sub = node.parent is not None
        allowed = w.visible_to(node, node.user, sub)
        assert got <= allowed, f"{node} was given markers of {got - allowed}"
        if not sub:  # everything its user's other conversations hold is recalled
            assert allowed - {w.marker(node)} <= got

    async def check_fresh(self, w: World, user: int) -> None:
        """A new sub-agent (and a new conversation), read-only, before it has stored anything."""
        tops = [n for n in w.nodes if n.user == user and n.parent is None]
        parent = next(n for n in w.nodes if n.user == user and n.parent is None)
        uid = f"u{w.ex}-{user}"
        got = await self.probe(w, {"X-Engram-User": uid, "X-Engram-Parent": parent.sid}, [])
        assert got == set(), f"a fresh sub-agent was given {got}"
        got = await self.probe(w, {"X-Engram-User": uid}, [])
        assert got == w.markers(tops)
        for other in (n for n in w.nodes if n.user != user):
            # Another user's session id names a session of this user's own (new, here).
            got = await self.probe(w, {"X-Engram-User": uid, "X-Engram-Session": other.sid}, [])
            assert got == w.markers(tops)
            async with self.http.post(
                self.engram.url + "/v1/chat/completions",
                headers={"X-Engram-User": uid, "X-Engram-Parent": other.sid},
                json={"messages": [{"role": "user", "content": "hello"}]},
            ) as r:
                assert r.status == 404
            break

    async def check_api(self, w: World, user: int) -> None:
        uid = f"u{w.ex}-{user}"
        mine = [n for n in w.nodes if n.user == user]
        others = [n for n in w.nodes if n.user != user]
        query = " ".join(sorted(w.markers(w.nodes)))
        status, body = await self.api("search", uid, q=query, k="100")
        assert status == 200
        found = {r["session"] for r in body["results"]}
        tops = {n.sid for n in mine if n.parent is None}
        assert found == tops  # every top-level session, never a sub-agent's raw turns
        for node in mine:  # a session-scoped search stays in that session
            status, body = await self.api("search", uid, q=query, k="100", session=node.sid)
            assert status == 200
            assert {r["session"] for r in body["results"]} <= {node.sid}
            got = set(MARKER.findall(json.dumps(body)))
            assert got <= {w.marker(node)}
        status, body = await self.api("sessions", uid)
        assert {s["id"] for s in body["sessions"]} == {n.sid for n in mine}
        for node in mine:
            status, body = await self.api(f"sessions/{node.sid}", uid)
            assert status == 200
            assert set(MARKER.findall(json.dumps(body))) == {w.marker(node)}
        for node in others:  # another user's sessions do not exist for this one
            status, body = await self.api(f"sessions/{node.sid}", uid)
            assert status == 404
            status, body = await self.api("search", uid, q=query, session=node.sid)
            assert status == 404
        status, lines = await self.api("export", uid)
        assert status == 200
        assert set(MARKER.findall(json.dumps(lines))) == w.markers(mine)


def test_nothing_crosses_a_boundary() -> None:
    loop = asyncio.new_event_loop()

    async def setup() -> tuple[FakeUpstream, Engram, aiohttp.ClientSession]:
        fake = FakeUpstream()
        await fake.start()
        engram = await start_engram(
            fake.url,
            retrieval={"top_k": 40, "budget_tokens": 1500},
            consolidation={"interval": 0},
            sessions={"complete_after_idle": 0},
        )
        return fake, engram, aiohttp.ClientSession()

    fake, engram, http = loop.run_until_complete(setup())
    harness = Harness(engram, fake, http)
    try:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(forests())
        def check(nodes: list[Node]) -> None:
            loop.run_until_complete(harness.run(nodes))

        check()
    finally:

        async def teardown() -> None:
            await http.close()
            await engram.close()
            await fake.stop()

        loop.run_until_complete(teardown())
        loop.close()
    print(  # reported with -s
        f"\nisolation: {harness.examples} generated cases, {harness.requests} chat requests, "
        f"{harness.probes} probes, {harness.api_calls} admin API calls"
    )
    assert harness.examples >= EXAMPLES // 2
