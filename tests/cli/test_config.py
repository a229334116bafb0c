"""The settings model: layering, validation messages, and config/engram.toml in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli.main import main
from proxy.config import ConfigError, load_settings, render_defaults

ROOT = Path(__file__).resolve().parents[2]


def test_config_file_matches_the_declared_defaults() -> None:
    assert (ROOT / "config" / "engram.toml").read_text() == render_defaults()


def test_defaults_file_loads_to_the_defaults() -> None:
    assert load_settings(ROOT / "config" / "engram.toml") == load_settings()


def test_layers_file_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 9001\nhost = "127.0.0.2"\n[upstream]\nurl = "http://a:1"\n')
    env = {"ENGRAM_SERVER_PORT": "9002", "ENGRAM_UPSTREAM_CONNECT_TIMEOUT": "2.5", "UNRELATED": "x"}
    s = load_settings(cfg, env, {"server": {"port": 9003}})
    assert s.server.port == 9003
    assert s.server.host == "127.0.0.2"
    assert s.upstream.url == "http://a:1"
    assert s.upstream.connect_timeout == 2.5
    s2 = load_settings(cfg, env)
    assert s2.server.port == 9002


def test_env_lists_and_bools() -> None:
    s = load_settings(
        None,
        {
            "ENGRAM_SERVER_ALLOWED_HOSTS": "a.local, b.local",
            "ENGRAM_SERVER_CORS_ORIGINS": '["http://x"]',
            "ENGRAM_SERVER_ALLOW_REMOTE": "yes",
        },
    )
    assert s.server.allowed_hosts == ["a.local", "b.local"]
    assert s.server.cors_origins == ["http://x"]
    assert s.server.allow_remote is True


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[server]\nprot = 1\n", "unknown key server.prot"),
        ("[servr]\nport = 1\n", "unknown section [servr]"),
        ('[server]\nport = "80"\n', "server.port = '80'"),
        ("[server]\nport = 70000\n", "an integer from 0 to 65535"),
        ('[server]\nlog_level = "loud"\n', "one of 'debug', 'info', 'warning', 'error'"),
        ("[server]\nallow_remote = 1\n", "true or false"),
        ("[server\n", "is not valid TOML"),
        ('[slots]\nexpand_tool = "my tool"\n', "slots.expand_tool = 'my tool'"),
        ('[slots]\nredis_url = "localhost:6379"\n', "a string matching"),
        ("[slots]\nmax_expansions = 0\n", "an integer from 1 to 20"),
    ],
)
def test_bad_files_name_the_key_and_accepted_values(
    tmp_path: Path, text: str, expected: str
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert expected in str(err.value)


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="ENGRAM_SERVER_PORT"):
        load_settings(None, {"ENGRAM_SERVER_PORT": "eighty"})
    with pytest.raises(ConfigError, match="unknown environment variable ENGRAM_SERVER_PROT"):
        load_settings(None, {"ENGRAM_SERVER_PROT": "1"})


def test_cli_stops_on_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[upstream]\nkind = "vllm"\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "upstream.kind" in err and "'llamacpp'" in err


def test_cli_refuses_non_loopback_without_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(Path("/nonexistent/engram.toml"))
