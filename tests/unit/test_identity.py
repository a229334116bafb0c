"""Identity: users, explicit sessions, the fingerprint chain, housekeeping; secret redaction."""

from __future__ import annotations

from proxy.chat.identity import identify, is_housekeeping
from proxy.messages import anchor_length, canonical, chain_hashes
from proxy.redact import redact


def test_user_and_session_sources_in_priority_order() -> None:
    h = {"X-Engram-User": "alice", "X-OpenWebUI-User-Id": "bob", "X-Session-Id": "s1"}
    ident = identify(h, {"user": "carol", "metadata": {"session_id": "s2"}})
    assert (ident.user, ident.explicit_session, ident.user_source) == ("alice", "s1", "header")
    ident = identify({}, {"user": "carol", "metadata": {"sessionId": "s3"}})
    assert (ident.user, ident.explicit_session) == ("carol", "s3")
    ident = identify({}, {"safety_identifier": "dave"})
    assert ident.user == "dave"


def test_api_key_is_hashed_never_stored() -> None:
    ident = identify({"Authorization": "Bearer sk-secret-key-123"}, {})
    assert ident.user.startswith("key-") and "secret" not in ident.user
    assert identify({"Authorization": "Bearer sk-secret-key-123"}, {}).user == ident.user
    assert identify({"Authorization": "Bearer sk-no-key-required"}, {}).user == "default"
    assert identify({}, {}).user == "default"


def test_unsafe_ids_are_hashed_stably() -> None:
    a = identify({"X-Engram-User": "ünï côde / spaces"}, {}).user
    assert a.startswith("h-") and a == identify({"X-Engram-User": "ünï côde / spaces"}, {}).user


def test_chain_extends_and_forks() -> None:
    base = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    longer = [*base, {"role": "user", "content": "more"}]
    assert chain_hashes(longer)[:3] == chain_hashes(base)
    edited = [base[0], {"role": "user", "content": "hi!"}, base[2]]
    assert chain_hashes(edited)[0] == chain_hashes(base)[0]
    assert chain_hashes(edited)[1:] != chain_hashes(base)[1:]
    # Content as parts or with extra whitespace canonicalises to the same message.
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert canonical(parts) == canonical({"role": "user", "content": " hi "})


def test_anchor_needs_an_assistant_reply() -> None:
    assert anchor_length([{"role": "user", "content": "hi"}]) is None
    assert (
        anchor_length(
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x"},
            ]
        )
        == 3
    )


def test_housekeeping_prompts_are_recognised() -> None:
    title = (
        "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
        "history.\n### Chat History:\n<chat_history>USER: hi</chat_history>"
    )
    assert is_housekeeping([{"role": "user", "content": title}])
    assert not is_housekeeping([{"role": "user", "content": "What is a good title for my essay?"}])


def test_redaction() -> None:
    text = (
        "my key is sk-proj-abcdefghijklmnopqrstuvwxyz123456 ok\n"
        "OPENAI_API_KEY=abc123def\n"
        "export DB_PASSWORD='hunter2'\n"
        "PATH=/usr/bin\n"
        "Authorization: Bearer abcdefghijklmnop1234\n"
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----\n"
        "gh ghp_abcdefghijklmnopqrstuvwxyz0123456789"
    )
    out = redact(text)
    for secret in (
        "abcdefghijklmnopqrstuvwxyz123456",
        "abc123def",
        "hunter2",
        "MIIEow",
        "abcdefghijklmnop1234",
        "ghp_abc",
    ):
        assert secret not in out
    assert "PATH=/usr/bin" in out and "my key is [REDACTED:openai-key] ok" in out
    assert redact("nothing to see here") == "nothing to see here"
