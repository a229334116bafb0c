"""Secret redaction: how long it takes on typical chat text, and what it changes there.

    .venv/bin/python -m bench.redact [--kb 100] [--runs 20] [--json out.json]

**The text.** Three kinds of 100 KB (``--kb``), each built from real text on this machine:
*prose*, LoCoMo's dialogue turns (``shared/bench/locomo/locomo10.json``, else this repository's
Markdown); *code*, Engram's own Python sources (full of ``token``, ``key``, ``secret`` and
``password`` as names, never as values); *tool output*, JSON Lines of those sources' lines as a
tool would return them (``{"path": …, "line": …, "text": …}``); and *mixed*, a third of each.
Every kind also gets one secret in 10 KB of text (a realistic fake, built at random) to measure
the cost when something is found.

**Reported.** Per kind, the median milliseconds per 100 KB over ``--runs`` runs of
:func:`proxy.redact.redact` and, for comparison, of the redaction Engram had before (kept in
this file as ``OLD_PATTERNS``); and how many redactions each makes in the clean text (ideally 0:
each is a false positive, listed with ``--show``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_LOCOMO, ROOT
from proxy.redact import MARK, redact

# The rules proxy/redact.py had before issue 12, for the comparison.
OLD_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z ]*PRIVATE KEY-----|$)"
        ),
        "[REDACTED PRIVATE KEY]",
    ),
    (
        re.compile(
            r"(?im)^(\s*(?:export\s+)?[A-Z0-9_.-]*(?:SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|API_?KEY"
            r"|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?|AUTH)[A-Z0-9_.-]*\s*[=:]\s*)(?!\[REDACTED)"
            r"(\S[^\n]*)$"
        ),
        r"\1[REDACTED]",
    ),
    (re.compile(r"(?i)\b(bearer|token)\s+[A-Za-z0-9._~+/=-]{16,}"), r"\1 [REDACTED]"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "[REDACTED]"),
    (re.compile(r"\b(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{20,}"), "[REDACTED]"),
    (
        re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{40,}"),
        "[REDACTED]",
    ),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), "[REDACTED]"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "[REDACTED]"),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), "[REDACTED]"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), "[REDACTED]"),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}\b"), "[REDACTED]"),
)


def old_redact(text: str) -> str:
    for pattern, repl in OLD_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def _fill(parts: list[str], size: int) -> str:
    out, n, i = [], 0, 0
    while n < size and parts:
        out.append(parts[i % len(parts)])
        n += len(parts[i % len(parts)]) + 1
        i += 1
    return "\n".join(out)[:size]


def prose(size: int, locomo: Path = DEFAULT_LOCOMO) -> str:
    if locomo.exists():
        data = json.loads(locomo.read_text())
        lines = [
            f"{turn['speaker']}: {turn['text']}"
            for conv in data
            for key, value in conv["conversation"].items()
            if key.startswith("session_") and isinstance(value, list)
            for turn in value
        ]
    else:
        lines = [ln for p in sorted(ROOT.glob("*.md")) for ln in p.read_text().splitlines()]
    return _fill(lines, size)


def _sources() -> list[Path]:
    return sorted((ROOT / "proxy").rglob("*.py"))


def code(size: int) -> str:
    return _fill([p.read_text() for p in _sources()], size)


def tool_output(size: int) -> str:
    lines = [
        json.dumps({"path": str(p.relative_to(ROOT)), "line": n, "text": text})
        for p in _sources()
        for n, text in enumerate(p.read_text().splitlines(), 1)
    ]
    return _fill(lines, size)


def with_secrets(text: str, seed: int) -> str:
    """``text`` with a realistic fake secret every 10 KB."""
    rng = random.Random(seed)
    alnum = string.ascii_letters + string.digits

    def rnd(n: int) -> str:
        return "".join(rng.choice(alnum) for _ in range(n))

    makers: list[Callable[[], str]] = [
        lambda: f"export GITHUB_TOKEN=gh{'p'}_{rnd(36)}",
        lambda: f'{{"password": "{rnd(14)}"}}',
        lambda: f"DATABASE_URL=postgres://app:{rnd(16)}@db:5432/app",
        lambda: f"Authorization: Bearer {rnd(40)}",
        lambda: f"aws_secret_access_key = {rnd(40)}",
    ]
    chunks = [text[i : i + 10_000] for i in range(0, len(text), 10_000)]
    return "\n".join(c + "\n" + rng.choice(makers)() for c in chunks)


def timed(fn: Callable[[str], str], text: str, runs: int) -> tuple[float, float]:
    """(median, fastest) milliseconds per 100 KB: the fastest is the figure to compare on a
    busy machine, the median what a run meets."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - start)
    scale = 1000 * (100_000 / len(text))
    return statistics.median(times) * scale, min(times) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--show", action="store_true", help="print each false positive")
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    size = args.kb * 1000
    kinds = {
        "prose": prose(size, args.locomo),
        "code": code(size),
        "tool output": tool_output(size),
    }
    kinds["mixed"] = "\n".join(t[: size // 3] for t in list(kinds.values()))
    results = {}
    print("ms per 100 KB, median (fastest) of the runs")
    print(f"{'text':<12} {'new':>15} {'old':>15} {'new, secrets':>15} {'FP new':>7} {'FP old':>7}")
    for name, text in kinds.items():
        out = redact(text)
        false_positives = [line for line in out.splitlines() if MARK in line and MARK not in text]
        dirty = with_secrets(text, 1)
        row: dict[str, Any] = {
            "chars": len(text),
            "new_ms_per_100kb": timed(redact, text, args.runs),
            "old_ms_per_100kb": timed(old_redact, text, args.runs),
            "with_secrets_ms_per_100kb": timed(redact, dirty, args.runs),
            "false_positives": len(false_positives),
            "old_false_positives": old_redact(text).count("[REDACTED"),
        }
        results[name] = row

        def cell(pair: tuple[float, float]) -> str:
            return f"{pair[0]:.1f} ({pair[1]:.1f})"

        print(
            f"{name:<12} {cell(row['new_ms_per_100kb']):>15} {cell(row['old_ms_per_100kb']):>15} "
            f"{cell(row['with_secrets_ms_per_100kb']):>15} {row['false_positives']:>7} "
            f"{row['old_false_positives']:>7}"
        )
        if args.show:
            for line in false_positives:
                print("   ", line.strip()[:160])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
