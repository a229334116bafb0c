"""The house's rules, checked on the source tree (issue 11): no import circle, the store imports
nothing above it, no SQL outside ``proxy/store``, no oversized module, a docstring on every
package and module."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
MAX_LINES = 460  # "about 450"; config.py (every setting declared once) is the exception
TOO_BIG_ALLOWED = {"config.py"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PROXY.rglob("*.py"):
        parts = list(path.relative_to(PROXY.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            found |= subs
            if len(subs) < len(node.names) and node.module in known:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known.keys()
    return found


def test_no_import_circle() -> None:
    known = modules()
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError(
                    "import circle: " + " -> ".join([*path[path.index(dep) :], dep])
                )
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_store_imports_nothing_above_it() -> None:
    known = modules()
    for m, p in known.items():
        if m.startswith("proxy.store"):
            above = {d for d in imports(p, known) if not d.startswith("proxy.store")}
            assert above <= {"proxy.vectors"}, (m, above)


def test_no_sql_outside_the_store() -> None:
    offenders = []
    for path in PROXY.rglob("*.py"):
        if path.relative_to(PROXY).parts[0] == "store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("execute", "executemany", "executescript")
                and node.args  # Redis pipelines' execute() takes none
            ):
                offenders.append(f"{path.relative_to(PROXY)}:{node.lineno}")
    assert offenders == []


def test_no_module_over_the_size_limit() -> None:
    big = {
        str(p.relative_to(PROXY)): n
        for p in PROXY.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES and p.name not in TOO_BIG_ALLOWED
    }
    assert big == {}


def test_every_module_says_its_job() -> None:
    missing = [
        str(p.relative_to(PROXY))
        for p in PROXY.rglob("*.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert missing == []
