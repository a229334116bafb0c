"""Redaction of secrets before anything is stored or logged (pure).

Two passes of rules over the text. First the shapes of known secrets
(:mod:`proxy.redact_rules`: vendor tokens, private key blocks, passwords in URLs, credential
headers), each run only when one of its keywords occurs in the text. Then assignments whose name
says secret — ``DB_PASSWORD=…``, ``"apiKey": "…"``, ``client_secret: …`` — where the value is
redacted when it looks like one: any real value for a password, a random-looking one (Shannon
entropy, length, character classes) for tokens and keys. Placeholders, code
(``token = tokenizer.encode(x)``), paths, URLs and plain words are left alone, so ordinary prose
and code read the same after redaction.

A secret becomes ``[REDACTED:<kind>]`` (``[REDACTED:aws-secret]``, ``[REDACTED:password]``), so
the text still says what was there. It is a safety net, not a guarantee: it errs towards
redacting.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import threading
from collections import Counter

from proxy.cache import LRU
from proxy.redact_rules import RULES, WORDLIKE, Rule

MARK = "[REDACTED"


def mark(kind: str) -> str:
    return f"{MARK}:{kind}]"


def entropy(text: str) -> float:
    """Shannon entropy of ``text`` in bits per character."""
    n = len(text)
    if n == 0:
        return 0.0
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


# --- the known shapes --------------------------------------------------------------------------

HEAD_CHARS = 64  # how far back a rule's ``head`` may reach


def _span(rule: Rule, text: str, m: re.Match[str]) -> tuple[int, int, str] | None:
    """The part of ``m`` to replace and its kind, or None when the match is no secret."""
    part = m.group(rule.group)
    if part is None or part.startswith(MARK):
        return None
    start, end = m.span(rule.group)
    if rule.head is not None:
        head = rule.head.search(text, max(0, m.start() - HEAD_CHARS), m.start())
        if head is None:
            return None
        if rule.group == 0:
            start, part = head.start(), text[head.start() : end]
    if rule.min_entropy and entropy(part) < rule.min_entropy:
        return None
    if rule.check is not None and not rule.check(m, part):
        return None
    kind = next((k for prefix, k in rule.kinds if part.startswith(prefix)), rule.kind)
    return start, end, kind


def _apply(rule: Rule, text: str) -> str:
    out: list[str] = []
    done = 0
    for m in rule.pattern.finditer(text):
        found = _span(rule, text, m)
        if found is None or found[0] < done:
            continue
        start, end, kind = found
        out += (text[done:start], mark(kind))
        done = end
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


# --- assignments whose name says secret -------------------------------------------------------

# A name part that says secret, then the rest of the name, a separator and a value (quoted, or
# up to the next space or punctuation). The whole name is read in :func:`_assignment`.
# One pattern per spelling of each word (a literal first keeps the engine's fast search).
_ASSIGNMENT_TAIL = (
    r"(?P<rest>[A-Za-z0-9_.\-]{0,40})"
    r"(?P<kq>\\?[\"'])?"
    r"(?P<sep>[ \t]{0,4}(?::=|=>|=|:)[ \t]{0,4})"
    r"(?:(?P<vq>\\?[\"'`])(?P<q>[^\"'`\\\r\n]{1,1000})(?P=vq)"
    r"|(?P<u>[^\s\"'`,;&<>()\[\]{}|\\]{1,1000}))"
)
_ASSIGNMENTS = tuple(
    re.compile(re.escape(spelling) + _ASSIGNMENT_TAIL)
    for word in ("pass", "pwd", "secret", "token", "key", "auth", "cred", "sig")
    for spelling in dict.fromkeys((word, word.capitalize(), word.upper()))
)
_NAME_BEFORE = re.compile(r"[A-Za-z0-9_.\-]{0,40}$")
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

_PASSWORD_WORDS = frozenset({"password", "passwd", "pwd", "passphrase", "passw", "pword"})
_CREDENTIAL_WORDS = frozenset(
    {"auth", "authorization", "oauth", "credential", "credentials", "creds", "cred"}
)
_SIGNATURE_WORDS = frozenset({"sig", "signature"})
# Words before "key" that make it a secret key.
_KEY_QUALIFIERS = frozenset(
    {
        "api", "access", "private", "secret", "signing", "sign", "encryption", "encrypt", "enc",
        "decryption", "master", "license", "licence", "client", "app", "account", "service",
        "shared", "consumer", "session", "subscription", "webhook", "hmac", "jwt", "admin",
        "root", "deploy", "storage", "auth", "ssh", "gpg", "pgp", "rsa", "aes", "cipher",
        "crypto", "x", "openai", "anthropic", "stripe", "aws", "azure", "gcp", "google",
    }
)  # fmt: skip
# A name with one of these words names something about a secret, not the secret.
_NOT_SECRET_ANY = frozenset(
    {
        "max", "min", "num", "count", "public", "pub", "csrf", "xsrf", "tokenizer", "tokenize",
        "tokenized", "keyboard", "keyword", "keywords", "keypress", "keydown", "keyup", "hotkey",
        "monkey", "turkey", "donkey", "hockey", "passed", "passing", "passage", "passenger",
        "bypass", "compass", "secretary", "author", "authors", "authority", "authored",
        "foreign", "primary", "sort", "partition", "design", "assign", "signal", "signals",
    }
)  # fmt: skip
# ... and so does a name ending in one of these.
_NOT_SECRET_LAST = frozenset(
    {
        "count", "counts", "length", "len", "size", "limit", "limits", "type", "types", "kind",
        "mode", "method", "methods", "id", "ids", "name", "names", "url", "uri", "urls",
        "endpoint", "host", "file", "files", "path", "paths", "dir", "env", "var", "header",
        "headers", "field", "fields", "policy", "provider", "enabled", "required", "expiry",
        "expires", "expiration", "expire", "ttl", "timeout", "version", "format", "prefix",
        "suffix", "index", "usage", "budget", "ratio", "rate", "used", "left", "remaining",
        "source", "location", "label", "hint", "prompt", "help", "regex", "pattern", "schema",
        "template", "placeholder", "position", "pos", "start", "end", "offset", "at", "date",
        "time", "example", "description", "desc", "class", "fn", "func", "callback",
        "handler", "strength", "reset", "hash", "algorithm", "alg", "scheme",
    }
)  # fmt: skip
_PLACEHOLDERS = frozenset(
    {
        "null", "none", "nil", "true", "false", "undefined", "yes", "no", "on", "off",
        "changeme", "password", "secret", "token", "redacted", "example", "xxx", "todo",
        "your_password", "your-password", "required", "optional", "str", "string", "bytes",
        "int", "bool", "any", "env", "hidden", "masked",
    }
)  # fmt: skip
_PLACEHOLDER_START = (
    "$",
    "<",
    "{",
    "%",
    "*",
    "...",
    "…",
    "#{",
    "@",
    "[REDACTED",
    "os.",
    "process.",
)
_HEX_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+")
_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PATH_START = ("/", "./", "../", "~/", "http://", "https://", "file:")


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORDS.findall(name)]


def secret_kind(name: str) -> str | None:
    """What a setting, variable or field called ``name`` holds, when it names a secret:
    ``password``, ``secret``, ``token``, ``api-key``, ``credential``, ``signature`` or ``key``
    (a bare ``key``: held to a stricter test of its value). None for other names."""
    words = _words(name)
    if not words or words[-1] in _NOT_SECRET_LAST or not _NOT_SECRET_ANY.isdisjoint(words):
        return None
    if words[-1] == "pass" or any(
        w in _PASSWORD_WORDS or w.endswith(("password", "passwd")) for w in words
    ):
        return "password"
    if any(w in ("secret", "secrets") or w.endswith("secret") for w in words):
        aws = "aws" in words or _follows(words, "secret", "access")  # SecretAccessKey
        return "aws-secret" if aws else "secret"
    if any(w == "token" or (w.endswith("token") and len(w) > 5) for w in words):
        return "token"
    if any(w.endswith("apikey") for w in words) or _follows(words, "api", "key"):
        return "api-key"
    if not _CREDENTIAL_WORDS.isdisjoint(words):
        return "credential"
    if not _SIGNATURE_WORDS.isdisjoint(words):
        return "signature"
    for i, w in enumerate(words):
        if w == "key" and (i > 0 and words[i - 1] in _KEY_QUALIFIERS):
            return "api-key" if words[i - 1] == "api" else "secret-key"
        if w.endswith("key") and w[:-3] in _KEY_QUALIFIERS:
            return "secret-key"
    return "key" if words == ["key"] else None


def _follows(words: list[str], first: str, second: str) -> bool:
    return any(a == first and b == second for a, b in itertools.pairwise(words))


def looks_random(value: str, *, strict: bool = False) -> bool:
    """Whether ``value`` looks like a generated secret rather than a word, a number, a name or
    an id: long enough, several kinds of character, and enough entropy for its length.
    ``strict`` (for a bare ``key``): longer, more entropy, letters and digits, no UUID."""
    n = len(value)
    if n < (20 if strict else 10) or value.isdigit():
        return False
    has_digit = any(c.isdigit() for c in value)
    has_upper = any(c.isupper() for c in value)
    has_lower = any(c.islower() for c in value)
    has_other = any(not c.isalnum() for c in value)
    bits = entropy(value)
    if strict:
        return has_digit and (has_upper or has_lower) and bits >= 4.0 and not _UUID.fullmatch(value)
    if not has_digit:  # letters only: a word or a name unless long and very mixed
        return n >= 20 and has_upper and has_lower and bits >= 4.0
    if sum((has_digit, has_upper, has_lower, has_other)) < 2:
        return False
    # Near the most a string of its length can have when short (log2 n: a random 12
    # characters from 62 has about 3.4), 3.5 bits from 16 characters on, as gitleaks does.
    return bits >= min(3.5, math.log2(n) - 0.3)


def _redact_value(kind: str, value: str, *, quoted: bool, env: bool) -> bool:
    low = value.lower()
    if (
        value.startswith(_PLACEHOLDER_START)
        or low in _PLACEHOLDERS
        or len(set(value)) <= 2
        or low.startswith(_PATH_START)
    ):
        return False
    if kind == "password":
        if quoted or env:
            return len(value) >= 3
        # Unquoted, as in YAML or prose: not a word (hyphenated or dotted), a label, a number
        # ("PASS: 4096") or a code reference.
        return (
            len(value) >= 6
            and not value.isdigit()
            and not WORDLIKE.fullmatch(value)
            and not _DOTTED_NAME.fullmatch(value)
        )
    if env:  # a .env line whose name says secret: anything but a word or a code reference
        return len(value) >= 4 and not (value.isalpha() and value.islower())
    if _DOTTED_NAME.fullmatch(value) or _HEX_NUMBER.fullmatch(value) or " " in value:
        return False
    return looks_random(value, strict=kind == "key")


def _assignment(m: re.Match[str]) -> str:
    text, start = m.string, m.start()
    head = _NAME_BEFORE.search(text, max(0, start - 40), start)
    before = head.group(0) if head else ""
    name = before + text[start : m.start("rest")] + m.group("rest")
    kind = secret_kind(name)
    if kind is None:
        return m.group(0)
    quoted = m.group("q") is not None
    value = m.group("q") if quoted else m.group("u")
    if not quoted and text[m.end() : m.end() + 1] in ("(", "["):
        return m.group(0)  # a call or an index: code, not a value
    name_start = start - len(before)
    env = (
        m.group("kq") is None
        and m.group("sep") == "="
        and name.isupper()
        and _line_start(text, name_start)
    )
    if not _redact_value(kind, value, quoted=quoted, env=env):
        return m.group(0)
    group = "q" if quoted else "u"
    whole = m.group(0)
    return whole[: m.start(group) - start] + mark(kind) + whole[m.end(group) - start :]


def _line_start(text: str, i: int) -> bool:
    """Whether only blanks or ``export`` stand between the line's start and ``i``."""
    line = text[text.rfind("\n", 0, i) + 1 : i].strip()
    return line in ("", "export")


# --- the pass -------------------------------------------------------------------------------


def redact(text: str) -> str:
    """``text`` with every secret found replaced by ``[REDACTED:<kind>]``."""
    if len(text) < 8:
        return text
    for rule in RULES:
        text = _apply(rule, text)
    for pattern in _ASSIGNMENTS:
        text = pattern.sub(_assignment, text)
    return text


class Redactor:
    """:func:`redact` that remembers its answers by the text's hash, for texts seen again and
    again (clients resend every old tool output on every request). Only changed texts are kept
    whole."""

    def __init__(self, capacity: int = 2048) -> None:
        self._seen: LRU[bytes, str] = LRU(capacity)  # hash -> redacted text, "" if unchanged
        self._lock = threading.Lock()  # called on the event loop and on worker threads

    def __call__(self, text: str) -> str:
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            found = self._seen.get(key)
        if found is not None:
            return found or text
        out = redact(text)
        with self._lock:
            self._seen[key] = "" if out == text else out
        return out
