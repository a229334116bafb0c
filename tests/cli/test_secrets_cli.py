"""What the commands show and write (issue 12, row 10): ``engram config`` masks secrets,
``engram doctor`` shows URLs without credentials, ``engram export -o`` writes a private file."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from proxy.cli.main import main
from proxy.config import Settings, load_settings
from testing.fake_upstream import FakeUpstream
from tests.cli.test_cli import env  # noqa: F401  (a fixture)
from tests.unit.test_redact import rnd


def test_engram_config_masks_every_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    token, redis_pw, up_pw, up_key = (rnd(s, 24) for s in ("tok", "redis", "up", "key"))
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ENGRAM_MEMORY_ADMIN_TOKEN", token)
    monkeypatch.setenv("ENGRAM_SLOTS_REDIS_URL", f"redis://engram:{redis_pw}@cache:6379/0")
    monkeypatch.setenv("ENGRAM_UPSTREAM_URL", f"https://me:{up_pw}@llm.example/v1?api_key={up_key}")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    for secret in (token, redis_pw, up_pw, up_key):
        assert secret not in out
    shown = json.loads(out)
    hidden = "********"
    assert shown["memory"]["admin_token"] == hidden
    assert shown["slots"]["redis_url"] == f"redis://engram:{hidden}@cache:6379/0"
    assert shown["upstream"]["url"].startswith(f"https://me:{hidden}@llm.example/v1?api_key=")
    assert shown["server"]["port"] == 8787  # the rest as it is


def test_settings_are_masked_by_name_so_new_ones_are_too() -> None:
    from proxy.masking import HIDDEN, is_secret_setting, masked_settings

    for name in ("admin_token", "api_key", "trusted_proxy_secret", "postgres_password", "apiKey"):
        assert is_secret_setting(name), name
    for name in ("redis_url", "redis_key_prefix", "budget_tokens", "min_tokens", "keep_recent"):
        assert not is_secret_setting(name), name
    # Every setting of today that is a string and named like a secret is masked.
    settings: Settings = load_settings(None, None, {"memory": {"admin_token": "x" * 12}})
    shown = masked_settings(settings)
    assert shown["memory"]["admin_token"] == HIDDEN
    assert shown["memory"]["redact_secrets"] is True  # a flag stays a flag
    assert masked_settings(load_settings())["memory"]["admin_token"] == ""  # unset stays unset


def test_urls_shown_to_anyone_lose_user_password_query_and_fragment() -> None:
    from proxy.masking import HIDDEN, display_url, masked_url

    pw = rnd("url", 16)
    assert display_url(f"http://u:{pw}@10.0.0.2:8080/v1?key={pw}#x") == "http://10.0.0.2:8080/v1"
    assert display_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert display_url("") == ""
    assert pw not in display_url(f"not a url postgres://a:{pw}@h/db")
    assert masked_url(f"redis://:{pw}@h:6379/0?password={pw}&db=1") == (
        f"redis://:{HIDDEN}@h:6379/0?password={HIDDEN}&db=1"
    )


@pytest.mark.asyncio
async def test_doctor_shows_urls_without_credentials(
    env: Path,  # noqa: F811
    fake: FakeUpstream,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pw, redis_pw = rnd("doc", 16), rnd("doc-redis", 16)
    monkeypatch.setenv("ENGRAM_SLOTS_REDIS_URL", f"redis://someone:{redis_pw}@127.0.0.1:1/0")
    upstream = fake.url.replace("http://", f"http://someone:{pw}@")
    await asyncio.to_thread(main, ["doctor", "--db", str(env), "--upstream", upstream])
    out = capsys.readouterr().out
    assert "ok   upstream" in out and fake.url in out
    assert "redis" in out
    assert pw not in out and redis_pw not in out and "someone" not in out


def test_export_file_is_private(
    env: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"user": "a", "session": "s", "role": "user", "content": "my cat is Miso"}\n')
    old = os.umask(0o022)
    try:
        assert main(["import", "--db", str(env), str(lines)]) == 0
        out = tmp_path / "export.jsonl"
        assert main(["export", "--db", str(env), "-o", str(out)]) == 0
    finally:
        os.umask(old)
    assert "Miso" in out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE(env.stat().st_mode) == 0o600  # the database import created
