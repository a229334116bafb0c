"""Consolidation: flagged requests become facts, within budget; failures and junk change nothing."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.background.facts import INSTRUCTIONS, Fact, parse_facts
from proxy.services import SERVICES
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, forwarded_memory, settle, start_engram

SISTER = "My sister Ilse moved to Tromso in March 2023, she works at the aquarium there."
FACT = '{"subject": "Ilse", "fact": "the user\'s sister Ilse lives in Tromso", "time": "2023-03"}'
FILLER = "Let us talk about the weather and nothing in particular. " * 150  # fits the context


async def start(fake: FakeUpstream, **consolidation: Any) -> Engram:
    """Engram without rolling summaries: every upstream call here is a chat or consolidation."""
    return await start_engram(fake.url, summary={"enabled": False}, consolidation=consolidation)


async def chat(
    http: aiohttp.ClientSession,
    engram: Engram,
    text: str,
    user: str = "u",
    path: str = "/v1/chat/completions",
    **headers: str,
) -> tuple[str, dict[str, Any]]:
    async with http.post(
        engram.url + path,
        headers={"X-Engram-User": user, **headers},
        json={"messages": [{"role": "user", "content": text}]},
    ) as r:
        assert r.status == 200
        return r.headers["X-Engram-Request-Id"], {k: r.headers[k] for k in r.headers}


async def post(
    http: aiohttp.ClientSession, engram: Engram, path: str, body: Any = None, user: str = "u"
) -> dict[str, Any]:
    async with http.post(
        f"{engram.url}/engram/api/{path}", headers={"X-Engram-User": user}, json=body
    ) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def search(http: aiohttp.ClientSession, engram: Engram, q: str, user: str = "u") -> Any:
    async with http.get(
        f"{engram.url}/engram/api/search", params={"q": q, "user": user, "k": "20"}
    ) as r:
        assert r.status == 200
        return (await r.json())["results"]


async def counts(engram: Engram) -> dict[str, int]:
    """Rows of everything memory holds."""
    store = engram.app[SERVICES].store

    def count(c: Any) -> dict[str, int]:
        return {
            t: int(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0])
            for t in ("sessions", "turns", "turns_fts", "turn_vec", "summaries")
        }

    return await store.read(count)


async def queue(engram: Engram) -> list[tuple[Any, ...]]:
    return await engram.app[SERVICES].store.read(
        lambda c: [
            tuple(r)
            for r in c.execute("SELECT status, attempts, facts, error FROM consolidation_queue")
        ]
    )


async def flagged(http: aiohttp.ClientSession, e: Engram, user: str = "u", **h: str) -> str:
    """The story, enough traffic to pay for a consolidation, and a flagged question."""
    await chat(http, e, SISTER, user, **{"X-Engram-Session": f"{user}-story"})
    await chat(http, e, FILLER, user, **{"X-Engram-Session": f"{user}-filler"})
    rid, _ = await chat(http, e, "Where does my sister live now?", user, **h)
    await settle(e)
    body = await post(
        http, e, "feedback", {"request_id": rid, "helpful": False, "note": "forgot Ilse"}, user
    )
    assert body["queued"] is True
    return rid


def no_usage(text: str) -> JsonReply:
    """A reply without ``usage``: the consolidator counts its own estimate (prompt + the
    reply's room), as it would for an upstream that reports nothing."""
    body = chat_completion(text)
    del body["usage"]
    return JsonReply(body)


def within_budget(e: Engram) -> tuple[int, int, float]:
    c = e.app[SERVICES].consolidator
    share = e.app[SERVICES].consolidator.settings.consolidation.budget_share
    assert c.tokens_spent <= share * c.tokens_proxied
    return c.tokens_spent, c.tokens_proxied, share


@pytest.mark.asyncio
async def test_facts_are_stored_deduplicated_and_found(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start(fake, budget_share=0.5, max_tokens=64)
    try:
        await flagged(http, e, **{"X-Engram-Session": "q"})
        fake.enqueue(no_usage(FACT + "\nIlse: works at the Tromso aquarium"))
        report = await post(http, e, "consolidate")
        assert (report["processed"], report["done"], report["facts"]) == (1, 1, 2)
        call = fake.chat_requests()[-1].json()
        assert call["max_tokens"] == 64
        system, user = call["messages"]
        assert "JSON" in system["content"] and "subject: fact" in system["content"]
        # The wider search found the story (and the user's note went with the question).
        assert "Ilse moved to Tromso" in user["content"] and "forgot Ilse" in user["content"]
        assert await queue(e) == [("done", 1, 2, None)]
        hits = await search(http, e, "Ilse Tromso sister")
        facts = [h for h in hits if h["role"] == "fact"]
        assert {(h["speaker"], h["content"], h["session"]) for h in facts} == {
            ("Ilse", "the user's sister Ilse lives in Tromso (2023-03)", "facts~u"),
            ("Ilse", "works at the Tromso aquarium", "facts~u"),
        }
        # A later request of another conversation is given the fact.
        await chat(http, e, "Does Ilse live in Tromso?", **{"X-Engram-Session": "later"})
        system = forwarded_memory(fake.chat_requests()[-1].json()["messages"])
        assert (
            'derived: fact about Ilse: "the user\'s sister Ilse lives in Tromso (2023-03)"'
            in system
        )
        # Flagged again with the same answer: nothing stored twice.
        await settle(e)
        before = await counts(e)
        rid, _ = await chat(http, e, "Where is Ilse?", **{"X-Engram-Session": "again"})
        await settle(e)
        await post(http, e, "feedback", {"request_id": rid, "helpful": False})
        before = await counts(e)
        fake.enqueue(JsonReply(chat_completion(FACT)))
        report = await post(http, e, "consolidate")
        assert (report["done"], report["facts"]) == (1, 0)
        assert await counts(e) == before
        spent, proxied, share = within_budget(e)
        print(f"\nconsolidation: spent {spent} of {proxied} proxied (share {share})")
        # Forgetting the story's session forgets the facts distilled from it.
        async with http.delete(
            f"{e.url}/engram/api/sessions/u-story", headers={"X-Engram-User": "u"}
        ) as r:
            assert r.status == 200
        assert [h for h in await search(http, e, "Ilse Tromso") if h["role"] == "fact"] == []
    finally:
        await e.close()


@pytest.mark.asyncio
async def test_over_budget_it_waits_and_spends_nothing(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start(fake, budget_share=0.001)
    try:
        await flagged(http, e)
        calls = len(fake.chat_requests())
        before = await counts(e)
        for _ in range(3):
            report = await post(http, e, "consolidate")
            assert (report["processed"], report["waiting"]) == (0, 1)
        assert len(fake.chat_requests()) == calls  # no upstream call at all
        assert await queue(e) == [("pending", 0, 0, None)]
        assert await counts(e) == before
        c = e.app[SERVICES].consolidator
        assert c.tokens_spent == 0 and c.waited == 3 and c.tokens_proxied > 0
        assert report["tokens_allowed"] == int(0.001 * c.tokens_proxied)
        print(f"\nconsolidation over budget: spent 0, allowed {report['tokens_allowed']}")
    finally:
        await e.close()


@pytest.mark.asyncio
async def test_at_the_default_share_it_waits_for_traffic_then_runs(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start(fake, max_tokens=64)
    try:
        await flagged(http, e)
        c = e.app[SERVICES].consolidator
        assert c.settings.consolidation.budget_share == 0.05
        report = await post(http, e, "consolidate")
        assert (report["processed"], report["waiting"], c.tokens_spent) == (0, 1, 0)
        waits, rounds = 1, 0
        while report["processed"] == 0:  # more traffic, until 5% of it pays for the call
            rounds += 1
            assert rounds < 40
            # Through the other chat path: the fake keeps its queue for /v1 to the consolidator.
            more = {"X-Engram-Session": "more"}
            await chat(http, e, FILLER + str(rounds), path="/chat/completions", **more)
            await settle(e)
            fake.enqueue(no_usage("Ilse: lives in Tromso since March 2023"))
            report = await post(http, e, "consolidate")
            waits += report["processed"] == 0
        assert (report["done"], report["facts"]) == (1, 1)
        spent, proxied, share = within_budget(e)
        print(
            f"\nconsolidation at {share:.0%}: waited {waits} passes, then spent {spent} of "
            f"{proxied} proxied ({spent / proxied:.2%})"
        )
    finally:
        await e.close()


@pytest.mark.asyncio
async def test_failures_and_junk_never_touch_memory(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start(fake, budget_share=0.5, max_tokens=64, max_attempts=3)
    try:
        await flagged(http, e)
        before = await counts(e)
        fake.enqueue(JsonReply({"error": {"message": "boom"}}, status=500))
        report = await post(http, e, "consolidate")
        assert (report["retried"], report["facts"]) == (1, 0)
        (entry,) = await queue(e)
        assert entry[:3] == ("pending", 1, 0) and "500" in entry[3]
        assert await counts(e) == before
        within_budget(e)
        # Junk: prose, the excerpts copied back, a template echo.
        source = fake.chat_requests()[-1].json()["messages"][1]["content"]
        echo = "\n".join(line for line in source.splitlines() if line.startswith("[#"))
        for junk in ("I am sorry, I cannot help with that.", echo):
            fake.enqueue(JsonReply(chat_completion(junk)))
            report = await post(http, e, "consolidate")
            assert report["facts"] == 0
            assert await counts(e) == before
            within_budget(e)
        assert report["failed"] == 1  # the third try was the last
        (entry,) = await queue(e)
        assert entry == ("failed", 3, 0, "the reply held no parseable fact")
        c = e.app[SERVICES].consolidator
        assert c.junk == 2 and c.call_failures == 1 and c.facts_stored == 0
        spent, proxied, share = within_budget(e)
        print(f"\nconsolidation failures: spent {spent} of {proxied} proxied (share {share})")
        # Nothing left to do: another pass makes no call.
        calls = len(fake.chat_requests())
        assert (await post(http, e, "consolidate"))["processed"] == 0
        assert len(fake.chat_requests()) == calls
    finally:
        await e.close()


@pytest.mark.asyncio
async def test_subagent_facts_stay_in_the_subagent(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start(fake, budget_share=0.5, max_tokens=64)
    try:
        _, h = await chat(http, e, "coordinate the family research")
        top = h["X-Engram-Session"]
        kid = {"X-Engram-Parent": top, "X-Engram-Session": "kid"}
        await chat(http, e, "The page says: the vault code is 4417.", **kid)
        await chat(http, e, FILLER, **{"X-Engram-Session": "filler"})
        rid, _ = await chat(http, e, "What is the vault code?", **kid)
        await settle(e)
        await post(http, e, "feedback", {"request_id": rid, "helpful": False})
        fake.enqueue(JsonReply(chat_completion("vault: the vault code is 4417")))
        report = await post(http, e, "consolidate")
        assert report["facts"] == 1
        excerpts = fake.chat_requests()[-1].json()["messages"][1]["content"]
        assert "weather" not in excerpts  # searched in the sub-agent's own session only
        store = e.app[SERVICES].store
        assert await store.get_session("facts~u") is None
        facts = [t for t in await store.session_turns("kid", from_position=-10) if t.role == "fact"]
        assert [(t.speaker, t.content) for t in facts] == [("vault", "the vault code is 4417")]
        # The parent never sees it; the sub-agent does.
        await chat(http, e, "what is the vault code 4417?", **{"X-Engram-Session": top})
        assert "fact about vault" not in json.dumps(fake.chat_requests()[-1].json())
        await chat(http, e, "the vault code again?", **kid)
        system = forwarded_memory(fake.chat_requests()[-1].json()["messages"])
        assert 'derived: fact about vault: "the vault code is 4417"' in system
    finally:
        await e.close()


def test_parse_facts_strict_with_a_plain_fallback() -> None:
    known = {11, 12}
    reply = "\n".join(
        [
            "```json",
            '{"subject": "Ilse", "fact": "lives in Tromso since 2023", "source_turns": [11, 99],'
            ' "time": "March 2023"}',
            "```",
            "- Bob: keeps two cats named Miso and Tofu",
            "1. Bob: keeps two cats named Miso and Tofu.",  # a duplicate
            '{"subject": 7, "fact": "mistyped subject here"}',
            '{"subject": "Ann", "fact": "bad ids here", "source_turns": "11"}',
            '{"subject": "Ann", "fact": "half-written',
            "user: I moved to Porto last spring",  # a role is not a subject
            "subject: fact",  # the template copied
            "Here are the facts:",
            "Carl: ok",  # says nothing
        ]
    )
    assert parse_facts(reply, known) == [
        Fact("Ilse", "lives in Tromso since 2023", (11,), "March 2023"),
        Fact("Bob", "keeps two cats named Miso and Tofu"),
    ]
    assert parse_facts('[{"subject": "Ilse", "fact": "works at the aquarium"}]', known) == [
        Fact("Ilse", "works at the aquarium")
    ]
    assert parse_facts("", known) == []
    assert parse_facts("I cannot answer that question.", known) == []
    source = "[#11 2024-01-01] Alice: I moved to Porto last spring\n[#12 2024-01-01] Bob: hi there"
    assert parse_facts("Alice: I moved to Porto last spring", known, source) == []
    assert parse_facts("Alice: moved to Porto last spring", known, source) == [
        Fact("Alice", "moved to Porto last spring")
    ]
    # The prompt's example copied, something the excerpts never said, what a 135M model wrote.
    example = "Alice's brother: Tom works as a nurse in Leeds"
    assert parse_facts(example, known, source, prompt=INSTRUCTIONS) == []
    assert parse_facts("Zed: flies planes over Jupiter daily", known, source) == []
    tiny = "The fact: The number 5.\nBob: the person you are is the person you are is the person"
    assert parse_facts(tiny, known, source + " number 5 person") == []
    capped = "\n".join(f"Item {i}: the fact number {i} is here" for i in range(20))
    assert len(parse_facts(capped, known, max_facts=5)) == 5
    assert Fact("A", "b c", (), "2023").content() == "b c (2023)"
