"""Redaction of obvious secrets before anything is written to memory (pure).

Covers provider API keys, bearer tokens, JWTs, private key blocks and `.env`-style lines whose
name looks secret. It is a safety net, not a guarantee: it errs towards redacting.
"""

from __future__ import annotations

import re

MARK = "[REDACTED]"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z ]*PRIVATE KEY-----|$)"
        ),
        "[REDACTED PRIVATE KEY]",
    ),
    # KEY=value lines (.env, shell exports, YAML-ish) whose name says secret.
    (
        re.compile(
            r"(?im)^(\s*(?:export\s+)?[A-Z0-9_.-]*(?:SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|API_?KEY"
            r"|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?|AUTH)[A-Z0-9_.-]*\s*[=:]\s*)(?!\[REDACTED)"
            r"(\S[^\n]*)$"
        ),
        r"\1" + MARK,
    ),
    (re.compile(r"(?i)\b(bearer|token)\s+[A-Za-z0-9._~+/=-]{16,}"), r"\1 " + MARK),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), MARK),
    (re.compile(r"\b(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{20,}"), MARK),
    (
        re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{40,}"),
        MARK,
    ),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), MARK),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MARK),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), MARK),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), MARK),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}\b"), MARK),
)


def redact(text: str) -> str:
    """``text`` with obvious secrets replaced by ``[REDACTED]``."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text
