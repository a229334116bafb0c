"""Write the documentation pages made from the code, so they cannot drift from it:
``docs/configuration.md`` from the settings model (:func:`proxy.config.render_markdown`) and
``docs/cli.md`` from the command line's parsers (:func:`proxy.cli.main.build_parser`).

    python -m scripts.docs           # write them (make docs)
    python -m scripts.docs --check   # exit 1, naming the page, when one differs (the tests)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from proxy.cli.main import build_parser
from proxy.config import render_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs"
WIDTH = "100"  # argparse wraps help text to $COLUMNS: fixed, so the page is the same anywhere


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render_cli() -> str:
    """``docs/cli.md``: ``engram --help`` and every command's (and sub-command's) help."""
    os.environ["COLUMNS"] = WIDTH
    parser = build_parser()
    parser.prog = "engram"
    lines = [
        "# The `engram` command",
        "",
        "<!-- Generated from proxy/cli/main.py by `make docs`; a test checks that this page and",
        "the parsers agree. -->",
        "",
        "Installed into `.venv/bin/engram` by `make run` (or `pip install .`). Every command takes",
        "`--config FILE` and the settings' flags; see [configuration](configuration.md). What the",
        "commands do to memory, the admin API does over HTTP: see [admin API and CLI](admin.md).",
        "",
        "```",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in _subparsers(parser).items():
        lines += ["", f"## `engram {name}`", "", "```", sub.format_help().rstrip(), "```"]
        for inner, leaf in _subparsers(sub).items():
            lines += ["", f"### `engram {name} {inner}`", "", "```", leaf.format_help().rstrip()]
            lines.append("```")
    return "\n".join(lines) + "\n"


def pages() -> dict[Path, str]:
    """Each generated page and the text it must hold."""
    return {DOCS / "configuration.md": render_markdown(), DOCS / "cli.md": render_cli()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    args = ap.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run `make docs`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
