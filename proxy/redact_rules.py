"""The shapes of known secrets: one :class:`Rule` per shape, in the order they are applied (pure).

Written after studying gitleaks' default rules (config/gitleaks.toml), not copied from them:
vendor tokens with a fixed prefix or layout, private key blocks, passwords in URLs, credential
headers. Every pattern starts with a literal (``ghp_``, ``-----BEGIN``, ``://``), so Python's
regular expression engine finds its candidates by a fast substring search: a rule whose literal
does not occur in a text costs about as much as ``literal in text``. A word boundary is checked
just after the literal (``(?<![A-Za-z0-9]ghp_)``), never before it, which would turn the fast
search off; a shape that has no leading literal (a Discord bot token) starts at a literal inside
it and checks what precedes that with ``head``. Secrets assigned to a name (``api_key = …``,
``"password": "…"``) or named in prose ("its secret key is …") are found by :mod:`proxy.redact`
itself, with an entropy check; their words and patterns are here, after the rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# What may not follow a token: another character of its alphabet.
_END = r"(?![A-Za-z0-9_\-])"


@dataclass(frozen=True)
class Rule:
    """One shape of secret. ``kind`` names it (or is picked by the first of ``kinds`` whose
    prefix the matched text starts with). ``group`` is the part replaced (0: the whole match,
    from ``head``'s start when there is one); it must carry at least ``min_entropy`` bits per
    character and pass ``check``. ``head``, when given, must match just before the match (it
    ends with ``$``)."""

    kind: str
    pattern: re.Pattern[str]
    group: int | str = 0
    min_entropy: float = 0.0
    check: Callable[[re.Match[str], str], bool] | None = None
    head: re.Pattern[str] | None = None
    kinds: tuple[tuple[str, str], ...] = ()


def _rule(
    kind: str,
    pattern: str,
    *,
    group: int | str = 0,
    min_entropy: float = 0.0,
    check: Callable[[re.Match[str], str], bool] | None = None,
    head: str | None = None,
    kinds: tuple[tuple[str, str], ...] = (),
) -> Rule:
    return Rule(
        kind,
        re.compile(pattern),
        group,
        min_entropy,
        check,
        re.compile(head) if head is not None else None,
        kinds,
    )


def _token(prefix: str, rest: str) -> str:
    """``prefix`` (a literal) not inside a longer word, then ``rest``, then a token's end."""
    lit = re.escape(prefix)
    return f"{lit}(?<![A-Za-z0-9_]{lit}){rest}{_END}"


# A word, a hyphenated or dotted name, a code identifier: not a credential.
WORDLIKE = re.compile(r"[A-Za-z]+(?:[\-_.][A-Za-z]+)*[:.,!?]?")


def _name_or_word(value: str) -> bool:
    """A plain word (lower, Title or UPPER case) or a name joined by ``-_.``, as opposed to a
    token that only looks like letters (base64 such as ``dXNlcjpwYXNz`` mixes cases)."""
    if not WORDLIKE.fullmatch(value):
        return False
    letters = value.rstrip(":.,!?")
    return not letters.isalpha() or letters.islower() or letters.istitle() or letters.isupper()


def _not_a_word(m: re.Match[str], value: str) -> bool:
    """A token after "Bearer" that is not a word or a name ("Bearer authentication")."""
    return not _name_or_word(value)


def _credential(m: re.Match[str], value: str) -> bool:
    """An Authorization value: after a scheme (Basic, Bearer…) anything but a word or a name;
    alone, something with digits too ("Authorization: required" and ``authorization =
    header_value`` are no credentials)."""
    if _name_or_word(value):
        return False
    return m.group("scheme") is not None or any(c.isdigit() for c in value)


def _has_digit(m: re.Match[str], value: str) -> bool:
    return any(c.isdigit() for c in value)


# Vendor tokens whose literal prefix says what they are: (prefixes, kind, the rest's pattern).
# Prefixes that share their first letters share one pass (one alternation after the literal).
_PREFIXED: tuple[tuple[str, str, str], ...] = (
    ("gh", "github-token", r"[pousr]_[A-Za-z0-9]{30,255}"),
    ("github_pat_", "github-token", r"[A-Za-z0-9_]{30,255}"),
    (
        "gl",
        "gitlab-token",
        r"(?:pat|dt|ptt|rt|cbt|ft|imt|agent|oas|soat|ffct)-[A-Za-z0-9_\-.]{20,300}",
    ),
    ("gl", "grafana-token", r"(?:c_[A-Za-z0-9+/]{32,}={0,2}|sa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8})"),
    ("npm_", "npm-token", r"[A-Za-z0-9]{36}"),
    ("pypi-AgE", "pypi-token", r"[A-Za-z0-9_\-]{50,}"),
    ("hf_", "huggingface-token", r"[A-Za-z0-9]{30,}"),
    ("api_org_", "huggingface-token", r"[A-Za-z0-9]{30,}"),
    ("whsec_", "stripe-key", r"[A-Za-z0-9+/=]{24,}"),
    ("rk_", "stripe-key", r"(?:live|test|prod)_[A-Za-z0-9]{10,99}"),
    ("xox", "slack-token", r"[abposre]-[A-Za-z0-9\-]{10,}"),
    ("xapp-", "slack-token", r"\d-[A-Za-z0-9\-]{10,}"),
    ("AIza", "google-api-key", r"[A-Za-z0-9_\-]{35}"),
    ("GOCSPX-", "google-oauth-secret", r"[A-Za-z0-9_\-]{24,}"),
    ("ya29.", "google-oauth-token", r"[A-Za-z0-9_\-]{20,}"),
    ("SG.", "sendgrid-key", r"[A-Za-z0-9_\-]{16,32}\.[A-Za-z0-9_\-]{16,64}"),
    ("SK", "twilio-key", r"[0-9a-fA-F]{32}"),
    ("key-", "mailgun-key", r"[0-9a-f]{32}"),
    ("AGE-SECRET-KEY-1", "age-secret-key", r"[0-9A-Z]{58}"),
    ("do", "digitalocean-token", r"[opr]_v1_[a-f0-9]{64}"),
    ("dapi", "databricks-token", r"[a-f0-9]{32}(?:-\d)?"),
    ("shp", "shopify-token", r"(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"),
    ("lin_api_", "linear-key", r"[A-Za-z0-9]{40}"),
    ("PMAK-", "postman-key", r"[a-fA-F0-9]{24}-[a-fA-F0-9]{34}"),
    ("pul-", "pulumi-token", r"[a-f0-9]{40}"),
    ("hv", "vault-token", r"(?:s\.[A-Za-z0-9_\-]{24,}|b\.[A-Za-z0-9_\-]{100,})"),
    ("sntry", "sentry-token", r"(?:s_[A-Za-z0-9+/=_]{40,}|u_[a-f0-9]{64})"),
    ("pplx-", "perplexity-key", r"[A-Za-z0-9]{40,}"),
    ("gsk_", "groq-key", r"[A-Za-z0-9]{40,}"),
    ("r8_", "replicate-token", r"[A-Za-z0-9]{37}"),
    ("xai-", "xai-key", r"[A-Za-z0-9]{60,}"),
    ("ntn_", "notion-token", r"[A-Za-z0-9]{40,}"),
    ("HRKU-", "heroku-key", r"[A-Za-z0-9_\-]{40,}"),
    ("ATATT3", "atlassian-token", r"[A-Za-z0-9_\-=]{100,}"),
    ("sq0", "square-token", r"(?:atp-[A-Za-z0-9_\-]{22,}|csp-[A-Za-z0-9_\-]{40,})"),
    ("fo1_", "flyio-token", r"[A-Za-z0-9_\-]{43}"),
    ("tskey-", "tailscale-key", r"[a-z]+-[A-Za-z0-9\-]{20,}"),
    ("sbp_", "supabase-token", r"[a-f0-9]{40}"),
    ("rubygems_", "rubygems-token", r"[a-f0-9]{48}"),
    ("dp.", "doppler-token", r"(?:pt|st)\.[A-Za-z0-9_\-.]{40,}"),
    ("FLWSECK-", "flutterwave-key", r"[A-Za-z0-9_\-]{32,}"),
    ("EAA", "facebook-token", r"[CM][A-Za-z0-9]{60,}"),
    ("ops_eyJ", "1password-token", r"[A-Za-z0-9+/]{200,}={0,3}"),
)

# The END line of a private key block, or the text's end for a block cut short.
_PEM_END = r"(?:-----END[A-Z0-9 _\-]{0,60}PRIVATE KEY(?: BLOCK)?-----|\Z)"
# After "Authorization": its colon (a quoted name too, as in JSON), an optional scheme, a value.
_AUTH_VALUE = (
    r"\\?[\"']?[ \t]*:[ \t]*\\?[\"']?"
    r"(?P<scheme>(?:[Bb]earer|[Bb]asic|[Tt]oken|[Dd]igest|[Nn]egotiate|[Bb]ot|[Aa]pi[Kk]ey|sso-key)"
    r"[ \t]+)?"
    r"(?P<v>[A-Za-z0-9._~+/=:\-]{6,})"
)

RULES: tuple[Rule, ...] = (
    # Private keys of every PEM kind (RSA, EC, DSA, OPENSSH, ENCRYPTED, PKCS#8) and PGP key
    # blocks, escaped newlines (JSON) included; a block cut short is redacted to the text's end.
    _rule(
        "private-key",
        r"-----BEGIN[A-Z0-9 _\-]{0,60}PRIVATE KEY(?: BLOCK)?-----[\s\S]*?" + _PEM_END,
        kinds=(("-----BEGIN PGP", "pgp-private-key"),),
    ),
    _rule("private-key", r"Private-Lines:[ \t]*\d+\r?\n(?:[A-Za-z0-9+/=]+\r?\n?)+"),
    # A password in a URL's userinfo: postgres://, mysql://, redis://, mongodb+srv://, amqp://,
    # https://… The user name stays; the password goes, even one with an unencoded '@'.
    _rule("url-password", r"://[^\s:/?#@'\"<>]*:([^\s/?#'\"<>]+)@", group=1),
    _rule(
        "slack-webhook",
        r"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/_\-]{20,}",
    ),
    _rule(
        "discord-webhook",
        r"discord(?:app)?\.com/api/webhooks/\d+/[A-Za-z0-9_\-]{20,}",
    ),
    # An AWS secret access key beside its key id (a credentials CSV); named ones are found as
    # assignments (aws_secret_access_key = …).
    _rule(
        "aws-secret",
        r"A(?<![A-Za-z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}(?![A-Za-z0-9])[^\n]{0,100}?"
        r"(?<![A-Za-z0-9/+])([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])",
        group=1,
        min_entropy=4.0,
    ),
    # Not a placeholder (AKIA and sixteen X's): random ids carry more than 2.7 bits.
    _rule(
        "aws-access-key-id",
        r"A(?<![A-Za-z0-9]A)(?:KIA|SIA|BIA|CCA|3T[A-Z0-9])[A-Z0-9]{16}(?![A-Za-z0-9])",
        min_entropy=2.5,
    ),
    _rule(
        "openai-key",
        _token(
            "sk",
            r"(?:-ant-[a-z]{2,8}\d{2}-[A-Za-z0-9_\-]{20,}"
            r"|-(?:proj-|svcacct-|admin-|or-v1-)?[A-Za-z0-9_\-]{20,}"
            r"|_(?:live|test|prod)_[A-Za-z0-9]{10,99})",
        ),
        check=_has_digit,
        kinds=(("sk-ant-", "anthropic-key"), ("sk_", "stripe-key")),
    ),
    _rule(
        "jwt",
        r"eyJ(?<![A-Za-z0-9_\-]eyJ)[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]*",
    ),
    *(_rule(kind, _token(prefix, rest), min_entropy=2.5) for prefix, kind, rest in _PREFIXED),
    # Shapes with no leading literal start at one inside them; ``head`` reads what precedes it.
    # A Discord bot token: the bot's id in base64, a timestamp, an HMAC.
    _rule(
        "discord-token",
        r"\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27,40}" + _END,
        head=r"(?<![A-Za-z0-9_\-.])[MNO][A-Za-z0-9_\-]{22,27}$",
        min_entropy=3.5,
    ),
    _rule("mailchimp-key", r"-us\d{1,2}(?![A-Za-z0-9])", head=r"(?<![A-Za-z0-9])[0-9a-f]{32}$"),
    _rule(
        "telegram-bot-token",
        r":AA[A-Za-z0-9_\-]{32,35}" + _END,
        head=r"(?<![0-9])\d{8,10}$",
    ),
    _rule(
        "azure-client-secret",
        r"Q~[A-Za-z0-9_~.\-]{31,34}(?![A-Za-z0-9_~.\-])",
        head=r"(?<![A-Za-z0-9_~.])[A-Za-z0-9_~.]{3}\d$",
    ),
    _rule("azure-storage-key", r"AccountKey[ \t]*=[ \t]*([A-Za-z0-9+/]{20,}={0,2})", group=1),
    _rule("azure-storage-key", r"SharedAccessKey[ \t]*=[ \t]*([A-Za-z0-9+/]{20,}={0,2})", group=1),
    _rule("azure-sas", r"sig=(?<=[?&]sig=)([A-Za-z0-9%+/=]{20,})", group=1),
    # Credentials in header lines and header-like pairs (curl -H, JSON dumps, HTTP traces).
    _rule("auth-header", r"uthorization" + _AUTH_VALUE, group="v", check=_credential),
    _rule("auth-header", r"AUTHORIZATION" + _AUTH_VALUE, group="v", check=_credential),
    *(
        _rule(
            "bearer-token", word + r"[ \t]+([A-Za-z0-9._~+/\-]{16,}=*)", group=1, check=_not_a_word
        )
        for word in ("Bearer", "bearer", "BEARER")
    ),
    *(
        _rule(
            "cookie",
            word + r"[ \t]*:[ \t]*(\S[^\r\n]*)",
            group=1,
            head=r"(?im)^[<>* \t]*(?:set-)?c$",
        )
        for word in ("ookie", "OOKIE")
    ),
    # curl -u user:password, --user user:password
    *(
        _rule("basic-auth", flag + r"[ =]?[\"']?[^\s:'\"]+:([^\s'\"]{3,})", group=1)
        for flag in (" -u", "--user")
    ),
)


# --- the words of names and phrases that say secret (read in proxy.redact) -----------------

PASSWORD_WORDS = frozenset({"password", "passwd", "pwd", "passphrase", "passw", "pword"})
CREDENTIAL_WORDS = frozenset(
    {"auth", "authorization", "oauth", "credential", "credentials", "creds", "cred"}
)
SIGNATURE_WORDS = frozenset({"sig", "signature"})
# Words before "key" that make it a secret key.
KEY_QUALIFIERS = frozenset(
    {
        "api", "access", "private", "secret", "signing", "sign", "encryption", "encrypt", "enc",
        "decryption", "master", "license", "licence", "client", "app", "account", "service",
        "shared", "consumer", "session", "subscription", "webhook", "hmac", "jwt", "admin",
        "root", "deploy", "storage", "auth", "ssh", "gpg", "pgp", "rsa", "aes", "cipher",
        "crypto", "x", "openai", "anthropic", "stripe", "aws", "azure", "gcp", "google",
    }
)  # fmt: skip
# A name with one of these words names something about a secret, not the secret.
NOT_SECRET_ANY = frozenset(
    {
        "max", "min", "num", "count", "public", "pub", "csrf", "xsrf", "tokenizer", "tokenize",
        "tokenized", "keyboard", "keyword", "keywords", "keypress", "keydown", "keyup", "hotkey",
        "monkey", "turkey", "donkey", "hockey", "passed", "passing", "passage", "passenger",
        "bypass", "compass", "secretary", "author", "authors", "authority", "authored",
        "foreign", "primary", "sort", "partition", "design", "assign", "signal", "signals",
    }
)  # fmt: skip
# ... and so does a name ending in one of these.
NOT_SECRET_LAST = frozenset(
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
PLACEHOLDERS = frozenset(
    {
        "null", "none", "nil", "true", "false", "undefined", "yes", "no", "on", "off",
        "changeme", "password", "secret", "token", "redacted", "example", "xxx", "todo",
        "your_password", "your-password", "required", "optional", "str", "string", "bytes",
        "int", "bool", "any", "env", "hidden", "masked",
    }
)  # fmt: skip
PLACEHOLDER_START = ("$", "<", "{", "%", "*", "...", "…", "#{", "@", "[REDACTED", "os.", "process.")
PATH_START = ("/", "./", "../", "~/", "http://", "https://", "file:")

# An assignment: after a word that says secret (the pattern's literal), the rest of the name, a
# separator and a value (quoted, or up to the next space or punctuation). The whole name is
# read in proxy.redact.
ASSIGNMENT_TAIL = (
    r"(?P<rest>[A-Za-z0-9_.\-]{0,40})"
    r"(?P<kq>\\?[\"'])?"
    r"(?P<sep>[ \t]{0,4}(?::=|=>|=|:)[ \t]{0,4})"
    r"(?:(?P<vq>\\?[\"'`])(?P<q>[^\"'`\\\r\n]{1,1000})(?P=vq)"
    r"|(?P<u>[^\s\"'`,;&<>()\[\]{}|\\]{1,1000}))"
)

# Secrets named in prose: "and its secret key is <value> (do not share)", "my GitHub token (the
# new one) is <value>", "the password for the db: <value>". After a word that says secret (the
# pattern's literal, in proxy.redact): the rest of the name, a possessive, closing markup; up
# to five words or a parenthesis; a connector (a sign, a table's bar, a dash, or a word: "is",
# "set to", "is now:"; the lookahead turns most words away at their first letter); one token,
# quoted or not, with a digit, a sign or a capital after a small letter in it (the engine turns
# plain words away itself: "is valid", "is stored in"). Its engine reads at most LONGEST.
LONGEST = 256
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"  # straight and curly quotes, a backtick
_DASHES = "\u2014|\u2013"  # an em dash, an en dash
_IN_QUOTES = "[^\\s*" + _QUOTES + "]"
_IN_VALUE = "[^\\s" + _QUOTES + "<>()\\[\\]{}|\\\\,;*]"


def _not_plain(char: str) -> str:  # a lookahead for a value of ``char``s that is no plain word
    other = char[2:-1]  # what the value may not hold
    return f"(?={char}*?(?:[0-9]|[^A-Za-z0-9.:!?{other}]|[.:!?]{char}|[a-z][A-Z]))"


_GAP = r"(?P<gap>(?:[ \t]{1,3}+(?:[A-Za-z0-9_'\u2019\-]{1,24}+|\([^()\r\n]{0,60}\))){0,5}?)"
_CONNECTOR = (
    r"[ \t]{0,3}+(?=[:=|\-\u2192\u21d2\u2014\u2013iwarebost])(?P<conn>:=|=>|->|\u2192|\u21d2"
    rf"|=(?![=>])|:(?![:/])|\|(?!\|)|{_DASHES}|(?<=[ \t])(?:-{{1,2}}(?=[ \t])"
    r"|(?:is|was|are|were|reads|equals|becomes|of|to|set[ \t]+to)(?![A-Za-z0-9_'\u2019\-])"
    rf"(?:[ \t]+(?:now|still|just|simply|actually))?(?:[ \t]*(?::|{_DASHES}|-{{1,2}}(?=[ \t])))?))"
)
_VALUE = (
    rf"[ \t]{{0,3}}+(?:(?P<pq>[{_QUOTES}]|\*\*)(?P<qv>{_not_plain(_IN_QUOTES)}{_IN_QUOTES}"
    rf"{{6,{LONGEST}}}+)(?=[{_QUOTES}]|\*\*)|(?:[{_QUOTES}]|\*\*)?"
    rf"(?P<v>{_not_plain(_IN_VALUE)}{_IN_VALUE}{{6,{LONGEST}}}))"
)
PROSE_TAIL = (
    r"(?P<prest>(?:[A-Za-z0-9_]|-(?=[A-Za-z0-9])){0,40}+)(?:['\u2019]s)?[*`]{0,2}+"
    + _GAP + _CONNECTOR + _VALUE
)  # fmt: skip
# The next connector and value after one that was no secret ("the password of the service
# account is …"); the rest of a value longer than LONGEST.
PROSE_NEXT = re.compile(_GAP + _CONNECTOR + _VALUE)
PROSE_MORE = re.compile(_IN_VALUE + "{1," + str(40 * LONGEST) + "}")

# A name in prose holds one of these words ("password", not "passport" or a "pass").
PROSE_WORDS = frozenset(
    {"secret", "token", "key", "apikey", "password", "passwd", "passphrase", "credential",
     "credentials", "creds", "cred"}
)  # fmt: skip
_ENDINGS = ("token", "secret", "password", "passwd", "passphrase", "apikey")
PROSE_ENDINGS = _ENDINGS + tuple(q + "key" for q in KEY_QUALIFIERS)  # "privatekey"
# A bare one of these is a weak name ("the token is …"): its value must be longer.
WEAK_WORDS = frozenset({"token", "secret", "credential", "credentials", "creds", "cred"})
# Words of a name that make it name something about a secret ("the token limit", "the key's
# fingerprint", "the length of the password"); "at", "used", "left" read as prose there.
PROSE_NOT_SECRET = (NOT_SECRET_LAST | NOT_SECRET_ANY | {
    "fingerprint", "fingerprints", "digest", "checksum", "sha1", "sha256", "sha512", "md5",
    "hashed", "hashes", "based", "protected", "manager", "store", "rotation", "scope", "scopes",
    "issuer", "audience", "owner", "claims", "permissions", "generator", "lifetime", "validity",
    "rules", "requirements", "column", "table", "window", "cost", "price", "estimate",
    "encoding", "encoder", "decoder", "embedding", "embeddings", "vocabulary", "vocab",
    "characters", "chars", "bytes", "bits", "digits",
}) - {"at", "used", "left"}  # fmt: skip
# Words that say a phrase is about a secret, not one ("the password hashing algorithm is …").
PROSE_ABOUT = frozenset(
    {"hash", "hashes", "hashed", "hashing", "algorithm", "algorithms", "policy", "policies",
     "length", "strength", "requirements", "rules", "format", "field", "prompt", "hint",
     "expiry", "expiration", "rotation", "manager", "generator", "validation", "complexity",
     "encoding", "scheme", "option", "flag", "parameter", "argument", "setting", "support"}
)  # fmt: skip
# "to" is a connector after a change ("I changed the password to …"), not "exported to PKCS#12".
CHANGE = re.compile(r"(?i)\b(?:set|change|changed|reset|update|updated|rotate|rotated)\b")
ENTITY = re.compile(r"&(?:quot|apos|amp|lt|gt|#\d+)")  # HTML-escaped quotes end a value
CALL = re.compile(r"[A-Za-z_][\w.]*\(")  # "Sign.sign()": code
# Words after the secret's word that still belong to its name ("secret access key").
PROSE_CONTINUE = frozenset({"key", "access", "secret", "token", "password", "phrase", "word"})
# Words that end the phrase before a name ("my GitHub token": "GitHub" belongs, "my" ends it).
ARTICLES = frozenset({"a", "an", "the", "my", "your", "our", "his", "her", "their", "its", "this"})
PROSE_STOP = ARTICLES | {
    "that", "these", "those", "some", "any", "no", "each", "every", "of", "for", "to", "in",
    "on", "at", "by", "with", "from", "into", "and", "or", "but", "is", "was", "are", "were",
    "be", "been", "if", "as", "so", "than", "then", "when", "which", "what", "where", "here",
    "there", "i", "you", "we", "they", "it", "he", "she", "use", "uses", "using", "set", "get",
    "new", "old", "current", "same", "own",
}  # fmt: skip
SINGULAR = {
    w + "s": w for w in ("token", "key", "secret", "password", "passphrase", "passwd", "apikey")
}

# What a value named in prose may be: one token of the base64 / base64url / hex alphabets (a
# password: any); no number, date, version or address, e-mail address, code name, placeholder.
ALPHABET = re.compile(r"[A-Za-z0-9+/=_\-.~]+")
DIGITS_AND_MARKS = re.compile(r"[0-9.:/\-_,+]+")
HEX = re.compile(r"[0-9a-f]+|[0-9A-F]+")
SEPARATORS = re.compile(r"[\-_.:,!?]+")
LETTERS_AND_SEPARATORS = re.compile(r"[A-Za-z\-_.:,!?]+")
EMAIL = re.compile(r"[\w.+\-]+@[\w\-]+(?:\.[\w\-]+)*\.[A-Za-z]{2,}")
# In one of its spellings: a random value holds one by chance once in 100,000.
PLACEHOLDER_WORDS = re.compile(
    "|".join(
        spelling
        for word in ("xxxx", "your", "example", "placeholder", "changeme", "dummy", "sample")
        for spelling in (word, word.capitalize(), word.upper())
    )
)
# A part of a code name: a word, camelCase words, an ACRONYM, a letter or a short number, with
# up to four digits after it (``tokenizer_config_v2``, ``MY_SECRET_TOKEN_V2``, ``getToken``).
# Possessive: no backtracking over how a long run of letters splits into words.
NAME_PART = re.compile(
    r"\d{1,4}|[A-Za-z]\d{0,4}"
    r"|(?:[A-Z]?[a-z]{2,}+|[A-Z]{2,}+(?![a-z])|[A-Z]{2,}?(?=[A-Z][a-z]))++\d{0,4}"
)

# One pattern per spelling of each word that says secret (a literal first keeps the engine's
# fast search), for an assignment or a secret named in prose after it, and the prose one alone
# (tried where an assignment is no secret); after "pwd", "auth" and "sig" assignments only.
NAMED: tuple[tuple[re.Pattern[str], re.Pattern[str] | None], ...] = tuple(
    (
        re.compile(re.escape(spelling) + f"(?:{ASSIGNMENT_TAIL}|{PROSE_TAIL})"),
        re.compile(re.escape(spelling) + PROSE_TAIL),
    )
    if word in ("pass", "secret", "token", "key", "cred")
    else (re.compile(re.escape(spelling) + ASSIGNMENT_TAIL), None)
    for word in ("pass", "pwd", "secret", "token", "key", "auth", "cred", "sig")
    for spelling in dict.fromkeys((word, word.capitalize(), word.upper()))
)
