"""Secret redaction (issue 12, item 9): one case per shape of secret, what must stay untouched,
the entropy check, and the cache.

Every fake secret is built here at run time from a seeded random generator and split literals,
so no string in this file has the shape of a real credential (secret scanners and GitHub's push
protection look at the source, not at what the tests make)."""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable

import pytest

from proxy.redact import Redactor, entropy, looks_random, redact, secret_kind

ALNUM = string.ascii_letters + string.digits
HEX = "0123456789abcdef"
B64 = ALNUM + "+/"
URLSAFE = ALNUM + "-_"


def rnd(seed: str, n: int, alphabet: str = ALNUM) -> str:
    """``n`` random characters (the same for the same seed): a fake secret's body."""
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


def p(*parts: str) -> str:
    """Join split literals: ``p("sk", "_live_")`` keeps token prefixes out of the source."""
    return "".join(parts)


def pem(label: str, seed: str) -> str:
    body = "\n".join(rnd(seed + str(i), 64, B64) for i in range(4))
    dashes = "-" * 5
    return f"{dashes}BEGIN {label}{dashes}\n{body}\n{dashes}END {label}{dashes}"


def jwt(seed: str) -> str:
    def part(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    header = part({"alg": "HS256", "typ": "JWT"})
    payload = part({"sub": rnd(seed, 12), "iat": 1700000000})
    return f"{header}.{payload}.{rnd(seed + 's', 43, URLSAFE)}"


def discord_bot(seed: str) -> str:
    bot_id = base64.b64encode(b"1" + rnd(seed, 17, "0123456789").encode()).decode().rstrip("=")
    return f"{bot_id}.{rnd(seed + 't', 6, URLSAFE)}.{rnd(seed + 'h', 38, URLSAFE)}"


AWS_ID = p("AK", "IA") + rnd("aws-id", 16, string.ascii_uppercase + "234567")
AWS_SECRET = rnd("aws-secret", 40, B64)

# (case, (text holding the secret, the secret), the kind it must be redacted as).
# The first group is what issue 12 found missed; the rest are shapes that must stay caught.
Case = tuple[str, Callable[[], tuple[str, str]], str]


def _s(template: str, secret: str) -> tuple[str, str]:
    return template.replace("{}", secret), secret


CASES: list[Case] = [
    # -- missed before issue 12 --
    (
        "postgres-url",
        lambda: _s("DATABASE_URL is postgres://app:{}@db.internal:5432/app", rnd("pg", 18)),
        "url-password",
    ),
    ("mysql-url", lambda: _s("mysql://root:{}@127.0.0.1/shop", rnd("my", 14)), "url-password"),
    ("redis-url", lambda: _s("use redis://:{}@cache:6379/0 now", rnd("rd", 20)), "url-password"),
    (
        "mongodb-srv-url",
        lambda: _s("mongodb+srv://svc:{}@cluster0.ab1cd.mongodb.net/db", rnd("mg", 16)),
        "url-password",
    ),
    ("amqp-url", lambda: _s("amqp://guest:{}@rabbit:5672/", rnd("mq", 12)), "url-password"),
    (
        "https-userinfo",
        lambda: _s("git clone https://deploy:{}@git.example.com/x.git", rnd("hu", 24)),
        "url-password",
    ),
    (
        "url-password-with-at",
        lambda: _s("postgresql://u:{}@host/db", rnd("at", 6) + "@" + rnd("at2", 6)),
        "url-password",
    ),
    ("json-password", lambda: _s('{"user": "ann", "password": "{}"}', rnd("jp", 11)), "password"),
    ("json-apikey", lambda: _s('{"apiKey": "{}", "region": "eu"}', rnd("ja", 32)), "api-key"),
    ("json-secret", lambda: _s('{"secret": "{}"}', rnd("js", 28)), "secret"),
    ("json-token", lambda: _s('{"token": "{}", "ttl": 3600}', rnd("jt", 40)), "token"),
    (
        "escaped-json-password",
        lambda: _s('"arguments": "{\\"password\\": \\"{}\\"}"', rnd("ej", 12)),
        "password",
    ),
    ("x-api-key-header", lambda: _s("X-Api-Key: {}\nAccept: */*", rnd("xk", 32)), "api-key"),
    (
        "authorization-basic",
        lambda: _s(
            "> Authorization: Basic {}",
            base64.b64encode(f"admin:{rnd('ba', 10)}".encode()).decode(),
        ),
        "auth-header",
    ),
    (
        "authorization-raw",
        lambda: _s('curl -H "Authorization: {}" https://api.x.io', rnd("ar", 30)),
        "auth-header",
    ),
    ("stripe-live", lambda: _s("key {} set", p("sk", "_live_") + rnd("sl", 24)), "stripe-key"),
    ("stripe-restricted", lambda: _s("{}", p("rk", "_live_") + rnd("rl", 24)), "stripe-key"),
    ("stripe-test", lambda: _s("STRIPE={}", p("sk", "_test_") + rnd("st", 24)), "stripe-key"),
    ("pgp-private-key", lambda: _pem_case("PGP PRIVATE KEY BLOCK", "pgp"), "pgp-private-key"),
    (
        "azure-storage",
        lambda: _s(
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={};"
            "EndpointSuffix=core.windows.net",
            rnd("az", 86, B64) + "==",
        ),
        "azure-storage-key",
    ),
    (
        "sendgrid",
        lambda: _s("SENDGRID {}", p("S", "G.") + rnd("sg1", 22, URLSAFE) + "." + rnd("sg2", 43)),
        "sendgrid-key",
    ),
    ("npm", lambda: _s("//registry/:x={}", p("np", "m_") + rnd("npm", 36)), "npm-token"),
    (
        "slack-webhook",
        lambda: _s(
            "post to {} please",
            p("https://hooks", ".slack.com/services/T")
            + rnd("sw1", 8).upper()
            + "/B"
            + rnd("sw2", 8).upper()
            + "/"
            + rnd("sw3", 24),
        ),
        "slack-webhook",
    ),
    (
        "slack-bot-token",
        lambda: _s(
            "{}",
            p("xo", "xb-")
            + rnd("sb1", 12, "0123456789")
            + "-"
            + rnd("sb2", 13, "0123456789")
            + "-"
            + rnd("sb3", 24),
        ),
        "slack-token",
    ),
    ("slack-user-token", lambda: _s("{}", p("xo", "xp-") + rnd("su", 40)), "slack-token"),
    ("discord-bot-token", lambda: _s("Authorization: Bot {}", discord_bot("db")), "discord-token"),
    (
        "discord-webhook",
        lambda: _s(
            "{}",
            p("https://discord", ".com/api/webhooks/")
            + rnd("dw1", 18, "0123456789")
            + "/"
            + rnd("dw2", 68, URLSAFE),
        ),
        "discord-webhook",
    ),
    ("twilio-api-key", lambda: _s("TWILIO {}", p("S", "K") + rnd("tw", 32, HEX)), "twilio-key"),
    ("mailgun", lambda: _s("api: {}", p("ke", "y-") + rnd("mgk", 32, HEX)), "mailgun-key"),
    (
        "telegram-bot",
        lambda: _s("bot {}", rnd("tg1", 10, "0123456789") + p(":A", "A") + rnd("tg2", 33)),
        "telegram-bot-token",
    ),
    (
        "google-oauth-secret",
        lambda: _s("{}", p("GOC", "SPX-") + rnd("go", 28)),
        "google-oauth-secret",
    ),
    (
        "aws-secret-csv",
        lambda: _s(f"Access key ID,Secret access key\n{AWS_ID},{{}}", AWS_SECRET),
        "aws-secret",
    ),
    (
        "aws-sts-json",
        lambda: _s('{"AccessKeyId": "ASIA...", "SecretAccessKey": "{}"}', AWS_SECRET),
        "aws-secret",
    ),
    (
        "azure-sas",
        lambda: _s("https://a.blob.core.windows.net/c?sv=2022&sig={}", rnd("sas", 43) + "%3D"),
        "azure-sas",
    ),
    (
        "client-secret-yaml",
        lambda: _s("oauth:\n  client_secret: {}\n", rnd("cs", 34)),
        "secret",
    ),
    ("yaml-password", lambda: _s("db:\n  password: {}\n", rnd("yp", 9) + "!7"), "password"),
    ("curl-user", lambda: _s("curl -u admin:{} https://x", rnd("cu", 12)), "basic-auth"),
    (
        "set-cookie",
        lambda: _s("< set-cookie: {}", "session=" + rnd("ck", 32) + "; HttpOnly"),
        "cookie",
    ),
    ("bearer-in-prose", lambda: _s("send Bearer {} along", rnd("br", 40)), "bearer-token"),
    (
        "pem-in-json",
        lambda: _s('{"private_key": "{}"}', _pem_case("PRIVATE KEY", "pj")[0].replace("\n", "\\n")),
        "private-key",
    ),
    ("ec-private-key", lambda: _pem_case("EC PRIVATE KEY", "ec"), "private-key"),
    ("openssh-private-key", lambda: _pem_case("OPENSSH PRIVATE KEY", "ssh"), "private-key"),
    ("encrypted-private-key", lambda: _pem_case("ENCRYPTED PRIVATE KEY", "enc"), "private-key"),
    (
        "pem-cut-short",
        lambda: _s("-----BEGIN RSA PRIVATE KEY-----\n{}", rnd("cut", 64, B64)),
        "private-key",
    ),
    # -- caught before, must stay caught --
    ("rsa-private-key", lambda: _pem_case("RSA PRIVATE KEY", "rsa"), "private-key"),
    ("aws-access-key-id", lambda: _s("id {} here", AWS_ID), "aws-access-key-id"),
    (
        "aws-secret-named",
        lambda: _s("[default]\naws_secret_access_key = {}\n", AWS_SECRET),
        "aws-secret",
    ),
    ("github-pat", lambda: _s("{}", p("gh", "p_") + rnd("gh", 36)), "github-token"),
    ("github-oauth", lambda: _s("{}", p("gh", "o_") + rnd("gho", 36)), "github-token"),
    ("github-app", lambda: _s("{}", p("gh", "s_") + rnd("ghs", 36)), "github-token"),
    (
        "github-fine-grained",
        lambda: _s("{}", p("github", "_pat_") + rnd("ghf", 22) + "_" + rnd("ghf2", 59)),
        "github-token",
    ),
    ("gitlab-pat", lambda: _s("{}", p("gl", "pat-") + rnd("gl", 20, URLSAFE)), "gitlab-token"),
    ("openai", lambda: _s("{}", p("s", "k-") + rnd("oa", 48)), "openai-key"),
    ("openai-project", lambda: _s("{}", p("sk", "-proj-") + rnd("op", 120, URLSAFE)), "openai-key"),
    (
        "anthropic",
        lambda: _s("{}", p("sk", "-ant-api03-") + rnd("an", 93, URLSAFE) + "AA"),
        "anthropic-key",
    ),
    (
        "google-api-key",
        lambda: _s("key={}", p("AI", "za") + rnd("gk", 35, URLSAFE)),
        "google-api-key",
    ),
    ("jwt", lambda: _s("token {}", jwt("jwt")), "jwt"),
    ("huggingface", lambda: _s("{}", p("h", "f_") + rnd("hf", 34)), "huggingface-token"),
    ("env-password", lambda: _s("export DB_PASSWORD='{}'", "hunter" + rnd("ep", 3)), "password"),
    ("env-api-key", lambda: _s("OPENAI_API_KEY={}\n", rnd("ek", 9)), "api-key"),
    ("env-quoted", lambda: _s('SERVICE_TOKEN="{}"\n', rnd("eq", 9)), "token"),
]


def _pem_case(label: str, seed: str) -> tuple[str, str]:
    block = pem(label, seed)
    return f"key file:\n{block}\nend", block


@pytest.mark.parametrize(("name", "make", "kind"), CASES, ids=[c[0] for c in CASES])
def test_each_shape_is_redacted_as_its_kind(
    name: str, make: Callable[[], tuple[str, str]], kind: str
) -> None:
    text, secret = make()
    assert secret in text
    out = redact(text)
    assert secret not in out, out
    assert f"[REDACTED:{kind}]" in out, out
    assert redact(out) == out  # a second pass changes nothing


def test_the_text_around_a_secret_is_kept() -> None:
    pw = rnd("keep", 16)
    out = redact(f"connect to postgres://app:{pw}@db:5432/app and run the migration")
    assert (
        out == "connect to postgres://app:[REDACTED:url-password]@db:5432/app and run the migration"
    )
    out = redact(f'{{"user": "ann", "password": "{pw}", "admin": false}}')
    assert json.loads(out) == {"user": "ann", "password": "[REDACTED:password]", "admin": False}


UNTOUCHED = [
    "I met my sister Ilse in Tromso last March; we talked about her job at the aquarium.",
    "The password must be at least 12 characters long and include a digit.",
    "Please keep this secret: I am planning a surprise party for Tom on Friday.",
    "Press the key: Enter, then Escape.",
    "The token limit is 4096 and the model counts tokens with tiktoken.",
    "Request 123e4567-e89b-12d3-a456-426614174000 failed after 3 retries.",
    '{"id": "3f2b8a34-7c1d-4e5f-9a6b-0c1d2e3f4a5b", "name": "report.pdf"}',
    "Fixed in commit 3f2a9c1e5b7d8f0a1b2c3d4e5f60718293a4b5c6 (see the changelog).",
    "git checkout 9fceb02 && git log --oneline -3",
    "Edit /home/ann/.config/engram/engram.toml and ~/.ssh/config, or ./secrets/README.md.",
    r"C:\Users\ann\AppData\Roaming\engram\engram.db",
    "token = tokenizer.encode(x)",
    "tokens = tokenizer.encode(text, add_special_tokens=False)",
    "max_tokens: 1024\ntoken_count = 55\nbudget_tokens = 2000",
    "password: str = Field(..., min_length=12)",
    'api_key = os.environ["OPENAI_API_KEY"]',
    "secret = get_secret(name)",
    "self.api_key = api_key",
    'headers = {"Authorization": f"Bearer {token}"}',
    '{"token_type": "bearer", "expires_in": 3600, "scope": "read"}',
    "PASSWORD_MIN_LENGTH=12\nTOKEN_TTL=3600\nAUTH_ENABLED=true\nSECRET_KEY_FILE=/run/secrets/key",
    "GITHUB_TOKEN=${{ secrets.GITHUB_TOKEN }}\nAPI_KEY=$API_KEY\nDB_PASSWORD=<your password>",
    "Authorization: required for every route except /health.",
    "Bear in mind that Bearer authentication sends the token in a header.",
    "Use sk-learn? No: scikit-learn, imported as sklearn.",
    "ssh://git@github.com:22/org/repo.git and git@github.com:org/repo.git",
    "http://localhost:8080/v1/chat/completions?stream=true#top",
    "Write to ann@example.com or visit https://example.com/docs?page=2.",
    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 is the digest.",
    "def get_token(self) -> str:\n    return self._token",
    "keyboard: us\nkeymap = default\nmonkey_patch = True",
    "if password == confirm_password:\n    save(user)",
    "The AKIA prefix marks AWS access key ids; ours rotate every 90 days.",
    "xoxo, Ann",
    "author: Ann\nauthority: tax office",
    "- PASS: 4096 zones: forwarded / full-history tokens 0.181 <= 0.2",
    "a pure pass-through: byte-identical, nothing stored",
    "ERRORTOKEN = 59\n_DD_SIGNATURE = 0x08074b50",
]


@pytest.mark.parametrize("text", UNTOUCHED)
def test_ordinary_text_and_code_are_not_redacted(text: str) -> None:
    assert redact(text) == text


def test_a_long_ordinary_text_is_returned_as_is() -> None:
    text = " ".join(UNTOUCHED) * 50
    assert redact(text) == text


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("DB_PASSWORD", "password"),
        ("passwd", "password"),
        ("apiKey", "api-key"),
        ("x-api-key", "api-key"),
        ("client_secret", "secret"),
        ("AWS_SECRET_ACCESS_KEY", "aws-secret"),
        ("SecretAccessKey", "aws-secret"),
        ("access_token_secret", "secret"),
        ("accessToken", "token"),
        ("GITHUB_TOKEN", "token"),
        ("private_key", "secret-key"),
        ("admin_token", "token"),
        ("trusted_proxy_secret", "secret"),
        ("credentials", "credential"),
        ("key", "key"),
        ("max_tokens", None),
        ("tokenizer", None),
        ("token_count", None),
        ("public_key", None),
        ("primary_key", None),
        ("redis_key_prefix", None),
        ("keyboard", None),
        ("password_min_length", None),
        ("auth_url", None),
        ("author", None),
        ("budget_tokens", None),
    ],
)
def test_secret_kind_reads_names(name: str, kind: str | None) -> None:
    assert secret_kind(name) == kind


def test_entropy_and_randomness() -> None:
    assert entropy("") == 0.0 and entropy("aaaa") == 0.0
    assert entropy("abcd") == pytest.approx(2.0)
    assert looks_random(rnd("r", 24))
    assert looks_random(rnd("h", 40, HEX))
    assert not looks_random("tokenizer.encode")
    assert not looks_random("version2")  # too short
    assert not looks_random("1234567890123")  # a number
    assert not looks_random("aaaaaaaaaaaaaaaa1")
    uuid = "3f2b8a34-7c1d-4e5f-9a6b-0c1d2e3f4a5b"
    assert not looks_random(uuid, strict=True)


def test_the_redactor_caches_and_agrees_with_redact() -> None:
    cached = Redactor(capacity=4)
    secret = p("gh", "p_") + rnd("cache", 36)
    for text in ("plain text, nothing here", f"token {secret}"):
        assert cached(text) == redact(text)
        assert cached(text) == redact(text)  # from the cache
    assert secret not in cached(f"token {secret}")
