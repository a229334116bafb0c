"""What every chat API shares: the protocol recorded per turn, shown by the admin API and the CLI;
errors in the API's own shape on its paths (each adapter's own tests cover its API end to end)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.chat.apis import api_for_path, chat_apis
from proxy.cli.main import main as engram_main
from testing.fake_upstream import FakeUpstream
from testing.harness import settle, start_engram


def test_every_adapter_serves_distinct_paths() -> None:
    apis = chat_apis()
    paths = [p for api in apis for p in api.paths]
    assert len(paths) == len(set(paths))
    assert len({api.name for api in apis}) == len(apis)
    assert api_for_path(apis, "/v1/chat/completions") is apis[0]
    assert api_for_path(apis, "/v1/models") is None


@pytest.mark.asyncio
async def test_the_protocol_of_each_turn_is_recorded_and_shown(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    engram = await start_engram(fake.url)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "my kite is vermilion"}]}
        headers = {"X-Engram-User": "ivy", "X-Engram-Session": "kites"}
        async with http.post(
            engram.base_url + "/chat/completions", json=body, headers=headers
        ) as r:
            assert r.status == 200
        await settle(engram)
        api = engram.url + "/engram/api"
        async with http.get(api + "/sessions/kites", params={"user": "ivy"}) as r:
            turns = (await r.json())["turns"]
        assert [t["api"] for t in turns] == ["openai-chat", "openai-chat"]
        async with http.get(api + "/search", params={"user": "ivy", "q": "vermilion kite"}) as r:
            results = (await r.json())["results"]
        assert results and all(hit["api"] == "openai-chat" for hit in results)
        db = f"{engram.tmp.name}/engram.db"
        argv = ["search", "vermilion kite", "--user", "ivy", "--db", db, "--mode", "fts"]
        assert await asyncio.to_thread(engram_main, argv) == 0
        assert "via openai-chat" in capsys.readouterr().out
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_an_error_on_a_chat_path_is_in_that_apis_shape(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(fake.url)
    try:
        for api in chat_apis():
            for path in api.paths:
                async with http.post(
                    engram.url + path,
                    data=b"{not json",
                    headers={"Content-Type": "application/json"},
                ) as r:
                    assert r.status == 400, path
                    body = await r.json()
                expected = api.error_body(400, "invalid_request_error", "x", None, None)
                assert set(body) == set(expected), path
    finally:
        await engram.close()
