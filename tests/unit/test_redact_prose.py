"""Secrets named in prose (the keyword-then-value family): "and its secret key is <40 random
base64 characters> (do not share)" was stored raw from a slotted tool output. A phrase that names
a secret, a few words, a connector and one generated-looking token is redacted; the prose and
code around such words read the same.

Fake secrets are built at run time from seeded generators and split literals, as in
:mod:`tests.unit.test_redact`, so no string here has the shape of a real credential."""

from __future__ import annotations

import base64
import random
import string
import time
from collections.abc import Callable

import pytest

from proxy.redact import redact
from tests.unit.test_redact import ALNUM, B64, HEX, URLSAFE, jwt, p, pem, rnd

AWS_ALPHABET = string.ascii_letters + string.digits + "+/"


def test_the_issues_sentence_is_redacted_for_200_random_secrets() -> None:
    rng = random.Random(12)
    for _ in range(200):
        secret = "".join(rng.choice(AWS_ALPHABET) for _ in range(40))
        out = redact(f"and its secret key is {secret} (do not share)")
        assert secret not in out
        assert out == "and its secret key is [REDACTED:secret] (do not share)", out


def test_an_aws_secret_in_prose_is_redacted_as_one_for_200_random_secrets() -> None:
    rng = random.Random(13)
    for _ in range(200):
        secret = "".join(rng.choice(AWS_ALPHABET) for _ in range(40))
        for text in (
            f"The AWS secret access key for prod is {secret}.",
            f"aws secret key: {secret}",
            f"Secret Access Key = {secret}",
        ):
            out = redact(text)
            assert secret not in out and "[REDACTED:aws-secret]" in out, out


# (case, template holding "{}", the secret's maker, the kind it is redacted as). Values are
# of the shapes vendors issue without a known prefix: base64, base64url, hex, alphanumeric.
Case = tuple[str, str, Callable[[], str], str]


def _b64(n: int, seed: str) -> Callable[[], str]:
    return lambda: rnd(seed, n, B64)


def _alnum(n: int, seed: str) -> Callable[[], str]:
    return lambda: rnd(seed, n, ALNUM)


def _url(n: int, seed: str) -> Callable[[], str]:
    return lambda: rnd(seed, n, URLSAFE)


def _hex(n: int, seed: str) -> Callable[[], str]:
    return lambda: rnd(seed, n, HEX)


def _fixed(value: str) -> Callable[[], str]:
    return lambda: value


UUID = p("3f2b8a34-7c1d-", "4e5f-9a6b-0c1d2e3f4a5b")  # Heroku's API keys are UUIDs
SLASHED = "/" + rnd("sl", 39, B64)  # one AWS secret in 64 starts with a slash
GITHUB = p("gh", "p_") + rnd("gp", 36)
OPENAI = p("sk", "-proj-") + rnd("op", 48)


POSITIVE: list[Case] = [
    ("secret-key-is", "and its secret key is {} (do not share)", _b64(40, "a"), "secret"),
    ("aws-for-prod", "the AWS secret key for prod is {}", _b64(40, "b"), "aws-secret"),
    ("github-paren", "my GitHub token (the new one) is {}", _alnum(40, "c"), "token"),
    ("password-for-db", "password for the db: {}", _fixed("Xy7#kq2!Lm"), "password"),
    ("api-key-is", "The API key is {}.", _alnum(32, "d"), "api-key"),
    ("api-key-arrow", "API-key \u2192 {}", _url(32, "e"), "api-key"),
    ("apikey-equals", "apikey equals {}", _hex(32, "f"), "api-key"),
    ("access-token-was", "the access token was {}", _url(43, "g"), "token"),
    ("passphrase-quoted", "The passphrase is '{}'", _fixed("Tr0ub4dor&3"), "password"),
    ("passwd-was", "passwd was {}", _fixed("Abc123!x"), "password"),
    ("private-key-hex", "the private key is {}", _hex(64, "h"), "secret-key"),
    ("client-secret-ascii-arrow", "client secret -> {}", _url(34, "i"), "secret"),
    ("credentials-are", "the credentials are {}", _b64(40, "j"), "credential"),
    ("signing-key-set-to", "the signing key is set to {}", _b64(44, "k"), "secret-key"),
    ("webhook-secret-reads", "the webhook secret reads {}", _alnum(32, "l"), "secret"),
    ("secret-access-key-em-dash", "Secret access key \u2014 {}", _b64(40, "m"), "aws-secret"),
    ("secret-key-becomes", "after rotation the secret key becomes {}", _b64(40, "n"), "secret"),
    ("api-key-of", "we got an API key of {} from them", _hex(32, "o"), "api-key"),
    ("token-backticks", "the token is `{}`", _url(30, "q"), "token"),
    ("token-double-quotes", 'The token is "{}".', _url(30, "r"), "token"),
    ("openai-key-without-prefix", "my OpenAI key is {}", _alnum(48, "s"), "secret-key"),
    ("stripe-api-key-for", "the Stripe API key for staging is {}", _alnum(32, "t"), "api-key"),
    ("access-key-is", "the access key is {}", _b64(40, "u"), "secret-key"),
    ("password-is-symbols", "The password is {}", _fixed("hunter22!"), "password"),
    ("password-is-now", "the new password is now {}", _fixed("Tr0ub4dor&3"), "password"),
    ("encryption-key-fat-arrow", "encryption key => {}", _b64(44, "v"), "secret-key"),
    ("bare-secret", "the secret is {}", _alnum(32, "w"), "secret"),
    ("heroku-uuid-key", "the Heroku API key is {}", _fixed(UUID), "api-key"),
    ("session-token-walrus", "session token := {}", _b64(40, "x"), "token"),
    ("wifi-password-digits", "the wifi password is {}", _fixed("83920174"), "password"),
    ("master-key-bold", "the master key is **{}**", _alnum(32, "y"), "secret-key"),
    ("env-name-in-prose", "GITHUB_TOKEN is {} for now", _alnum(40, "z"), "token"),
    ("token-possessive", "the token's value is {}", _b64(40, "aa"), "token"),
    ("password-2nd-connector", "the password of bot-account is {}", _fixed("Pa55-w!"), "password"),
    ("auth-token-dash", "auth token - {}", _url(40, "ab"), "token"),
    ("changed-to", "I changed the password to {} yesterday", _fixed("Tr0ub4dor&3"), "password"),
    ("set-the-token-to", "set the API token to {}", _url(40, "ai"), "token"),
    ("bearer-token-colon-filler", "bearer token for the CI: {}", _b64(40, "ac"), "token"),
    ("markdown-label", "**API key**: {}", _alnum(32, "ad"), "api-key"),
    ("markdown-table", "| Secret key | {} |", _b64(40, "ae"), "secret"),
    ("secret-key-was-quoted-curly", "the secret key was \u201c{}\u201d", _b64(40, "af"), "secret"),
    ("api-key-for-user", "the API key for user 42 is {}", _hex(40, "ag"), "api-key"),
    ("the-password-was-hunter2", "Sure, the password is {}.", _fixed("hunter2"), "password"),
    ("keys-plural", "the API keys are {} and more", _alnum(32, "ah"), "api-key"),
    ("secret-starting-with-slash", "its secret key is {}", _fixed(SLASHED), "secret"),
    # base64 of text reads like a Basic credential (base64 of "user:password"): not decoded,
    # redacted after a strong name (after a bare "token" it is too short: see UNCHANGED).
    (
        "base64-of-words",
        "the API token is {}",
        _fixed(base64.b64encode(b"hello world").decode()),
        "token",
    ),
    # Known shapes after a keyword keep their own kinds (the first pass finds them).
    ("github-prefix", "my GitHub token is {}", _fixed(GITHUB), "github-token"),
    ("jwt", "the access token is {}", lambda: jwt("pj"), "jwt"),
    ("openai-prefix", "the OpenAI key is {}", _fixed(OPENAI), "openai-key"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "template", "make", "kind"), POSITIVE, ids=[c[0] for c in POSITIVE]
)
def test_each_shape_in_prose_is_redacted(
    name: str, template: str, make: Callable[[], str], kind: str
) -> None:
    secret = make()
    text = template.replace("{}", secret)
    out = redact(text)
    assert secret not in out, out
    assert out == template.replace("{}", f"[REDACTED:{kind}]"), out
    assert redact(out) == out


def test_an_aws_key_id_and_secret_in_prose_keep_their_kinds() -> None:
    key_id, secret = p("AK", "IA") + rnd("id", 16, string.ascii_uppercase), rnd("s", 40, B64)
    out = redact(f"the access key is {key_id} and the secret key is {secret}")
    assert out == (
        "the access key is [REDACTED:aws-access-key-id] and the secret key is [REDACTED:aws-secret]"
    )


def test_a_pem_block_after_private_key_stays_one_redaction() -> None:
    block = pem("RSA PRIVATE KEY", "pk-prose")
    out = redact(f"the private key is {block} and nothing else")
    assert out == "the private key is [REDACTED:private-key] and nothing else"


def test_a_long_value_is_redacted_whole() -> None:
    der = rnd("der", 1600, B64)  # a private key's DER in base64 on one line
    out = redact(f"the private key is {der} (PKCS#8)")
    assert out == "the private key is [REDACTED:secret-key] (PKCS#8)"


UNCHANGED = [
    # The brief's cases.
    "the token is valid for 3600 seconds",
    "the secret key is stored in Vault",
    "the api key is in ~/.config/openai",
    "password is required",
    "token = tokenizer.encode(text)",
    "the key is 42",
    "the access key is AKIA... (a placeholder like " + p("AK", "IA") + "X" * 16 + ")",
    "Fixed in commit 3f2a9c1e5b7d8f0a1b2c3d4e5f60718293a4b5c6.",
    "checksum: sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "request id 123e4567-e89b-12d3-a456-426614174000 failed",
    # Words that name something about a secret.
    "The token limit is 4096 and the token count is 1234567890123.",
    "the token's sha256 is e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "the key fingerprint is SHA256:nThbg6kXUpJWGl7E1IGOCspRomTxdCARLviKw6E5SY8",
    "the public key is AAAAC3NzaC1lZDI1NTE5AAAAIGvQe1Wq5d7Kp8Xq1xF3a",
    "the length of the password is 12, the hash of the token is e3b0c44298fc1c149afbf4c8996fb924",
    "the token id is 3f2b8a34-7c1d-4e5f-9a6b-0c1d2e3f4a5b",
    "the API key header is X-Api-Key.",
    "the secret name is prod/db/password",
    "the credentials file is ~/.aws/credentials",
    "the token endpoint is https://oauth2.googleapis.com/token",
    "the cache key is 3f2a9c1e5b7d8f0a1b2c3d4e5f60718293a4b5c6",
    "the primary key is 8f14e45fceea167a5a36dedd4bea2543",
    "the CSRF token is 8f14e45fceea167a5a36dedd4bea2543",
    "max_tokens is 4096; the token budget is 200000",
    # Placeholders, references and code.
    "The API key is loaded from OPENAI_API_KEY at start-up.",
    "the token is `os.environ['GITHUB_TOKEN']`",
    "the api key is ${OPENAI_API_KEY} or <your-api-key>",
    "the secret key is changeme123",
    "the token is xxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "the password is ********",
    "the api key is sk-...abcd (elided)",
    "the secret is stored at /run/secrets/db_password",
    "the token is tokenizer_config_v2.json",
    "the token is MY_SECRET_TOKEN_V2",
    "the key is `config.api_key`",
    "secret_key = settings.SECRET_KEY",
    "token \u2192 tokenizer.decode(ids)",
    "const token = await getToken();",
    "password: str = Field(..., min_length=12)",
    "if password == confirm_password:",
    "the AES key is 0x00112233445566778899aabbccddeeff",
    # Plain prose.
    "The secret key is a 256-bit random value.",
    "the password is the same as ann@example.com",
    "the password field is 'Enter your password'",
    "the EOS token is </s> and the pad token id is 0",
    "the secret to success is persistence",
    "the password was changed on 2024-01-01 from 10.0.0.12",
    "the secret is that there is no secret",
    "Your API key is shown only once.",
    "The special tokens are <|im_start|> and <|im_end|>.",
    "| Token | Purpose |\n|---|---|\n| token_count | 12345678 |",
    "KeyError: 'api_key_v2_2024'",
    "PASSED tests/unit/test_tokens.py::test_token_is_counted",
    # Changelogs (found in /usr/share/doc): "to" is a connector only after a change.
    "certtool: do not ask for password when exporting to PKCS#12 implicitly",
    "passwords are normalized according to RFC7613. When invalid UTF-8",
    "- Add ldap_parse_password_expiring_control to libldap-2.4-2.symbols.",
    "- The default password hashing algorithm is now Argon2id. The",
    "  printf(&quot;Password is correct.&quot;);",
    "* Added support for passing in a passphrase for decrypting the signing key to `Sign.sign()`.",
    "I sent the token to Ab3dE5fG7hJ9kL1mN3pQ5xZ for review",
    # After a bare "token" or "secret" a value needs 20 characters: 16 (base64 of "hello world"
    # here) are as often an id or a digest in a chat about tokenizers.
    "the token is " + base64.b64encode(b"hello world").decode(),
    # Passwords: a plain word or a passphrase of words is not taken for one in prose.
    "the password is dragon",
    "the password is correct-horse-battery-staple",
]


@pytest.mark.parametrize("text", UNCHANGED)
def test_prose_and_code_about_secrets_read_the_same(text: str) -> None:
    assert redact(text) == text


def test_an_assignments_slash_secret_is_not_taken_for_a_path() -> None:
    secret = "/" + rnd("slash", 39, B64)  # one AWS secret in 64 starts with a slash
    out = redact(f"[default]\naws_secret_access_key = {secret}\n")
    assert out == "[default]\naws_secret_access_key = [REDACTED:aws-secret]\n"
    assert redact("secret_dir: /run/secrets/app") == "secret_dir: /run/secrets/app"


def test_a_bare_key_named_by_the_words_before_it() -> None:
    secret = rnd("named-key", 40, B64)
    assert redact(f"Secret Access Key: {secret}") == "Secret Access Key: [REDACTED:aws-secret]"
    assert redact(f"API Key: {secret}") == "API Key: [REDACTED:api-key]"


@pytest.mark.parametrize(
    "text",
    [
        "secret " * 15_000,
        "token is " * 12_000,
        "secret:" * 15_000,
        "token-" * 18_000,
        "token = value_name, " * 5_000,
        "the password is hunter2 " * 4_000,
        ("the token is " + "Ab1" * 300 + " ") * 100,
        ("secret is " + "abcdefghij" * 90 + " ") * 100,
        f'secret = "{p("sk", "-proj-")}abcdefghijklmnopqrstuvwxyz0123456789"\n' * 2_000,
    ],
    ids=lambda t: t[:12],
)
def test_keyword_heavy_texts_take_no_long_time(text: str) -> None:
    """No pattern backtracks without bound (a value of one long word once took 55 ms)."""
    start = time.perf_counter()
    redact(text)
    assert time.perf_counter() - start < 5.0
