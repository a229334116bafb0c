"""Installs and finds the real clients that :mod:`testing.agents` runs: Claude Code, Codex,
opencode and Qwen Code from the npm registry, aider from PyPI, at the versions pinned in
``testing/agents.pins``.

``python -m testing.agents_install`` (``make agents-deps``) runs ``npm install`` with install
scripts off into ``${XDG_CACHE_HOME:-~/.cache}/engram/agents/<client>-<version>_.../``, and
``pip install`` of each PyPI pin into its own virtualenv there (``pypi/<client>``: aider's
dependencies conflict with Engram's), with a Python its package accepts (this one, else
``python3.12`` … on PATH). All into a ``.partial`` folder first, renamed into place once each
client answered ``--version`` and the stamp ``engram-agents.json`` (the binaries chosen, the time
npm and pip took, the size) was written last, so an interrupted install never looks complete. A
second install waits on a lock. ``ENGRAM_AGENTS_DIR`` names another npm prefix to use instead
(nothing is installed there; PyPI clients are looked for in its ``pypi/<client>``).
Claude Code and opencode run their native binaries from the platform packages (their ``.bin``
wrappers are placeholders until a postinstall script copies the binary over them); the best one
for this machine first (its libc, then AVX2 or the baseline build). Codex and Qwen Code run their
``.bin`` node launchers. A PyPI client runs as ``<virtualenv>/bin/python -m <module>`` (its
scripts' ``#!`` lines name the ``.partial`` folder). Without npm it says so and succeeds: the
agent tests then skip (fail under ``CI=true``).

Standard library only: the Makefile runs it before anything else is installed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PINS_FILE = Path(__file__).with_name("agents.pins")
STAMP = "engram-agents.json"
CLIENTS = ("claude", "codex", "opencode", "qwen", "aider")
# Inside each client's platform package (Codex's node launcher finds its own).
NATIVE = {"claude": "claude", "opencode": "bin/opencode"}
PYPI = "pypi:"  # a pin's package from PyPI, not npm
# A PyPI client: the module ``python -m`` runs, and the Pythons its package accepts (best first).
MODULES = {"aider": "aider"}
PYTHONS = {"aider": ((3, 12), (3, 11), (3, 10))}  # aider-chat 0.86: Requires-Python <3.13,>=3.10


class AgentsMissing(RuntimeError):
    """The pinned clients are not installed (or npm is missing); the message says what to do."""


@dataclass(frozen=True)
class Pin:
    client: str
    package: str
    version: str

    @property
    def pypi(self) -> str | None:
        """The PyPI distribution's name, for a PyPI pin."""
        return self.package.removeprefix(PYPI) if self.package.startswith(PYPI) else None


@dataclass(frozen=True)
class Agents:
    root: Path
    binaries: dict[str, Path]  # a PyPI client's: its virtualenv's Python
    versions: dict[str, str]

    def __getitem__(self, client: str) -> Path:
        return self.binaries[client]

    def command(self, client: str) -> list[str]:
        """What runs ``client``: its binary, or ``python -m <module>`` for a PyPI client."""
        return _command(client, self.binaries[client])


def read_pins(path: Path = PINS_FILE) -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"{path}:{n}: expected '<client> <npm package> <version>'")
        pins[parts[0]] = Pin(*parts)
    if missing := set(CLIENTS) - pins.keys():
        raise ValueError(f"{path}: no pin for {', '.join(sorted(missing))}")
    return pins


def cache_name(pins: dict[str, Pin]) -> str:
    return "_".join(f"{c}-{pins[c].version}" for c in sorted(pins))


def agents_dir(pins: dict[str, Pin] | None = None) -> Path:
    """``ENGRAM_AGENTS_DIR``, else this pin set's folder in the cache."""
    if override := os.environ.get("ENGRAM_AGENTS_DIR"):
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "engram" / "agents" / cache_name(pins or read_pins())


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _candidates(root: Path, pin: Pin) -> list[Path]:
    """The client's runnable binaries under the npm prefix ``root``, best first."""
    if pin.pypi:
        python = root / "pypi" / pin.client / "bin" / "python"
        return [python] if python.exists() else []
    modules = root / "node_modules"
    if pin.client not in NATIVE:
        return [modules / ".bin" / pin.client]
    try:
        manifest = json.loads((modules / pin.package / "package.json").read_text())
    except (OSError, ValueError):
        return []
    musl = Path("/lib/ld-musl-x86_64.so.1").exists() or Path("/lib/ld-musl-aarch64.so.1").exists()
    avx2 = _cpu_has_avx2()

    def rank(name: str) -> tuple[bool, bool]:  # matching libc first, then the CPU's build
        return ("musl" in name) != musl, ("baseline" in name) == avx2

    names = sorted(manifest.get("optionalDependencies") or {}, key=rank)
    found = [modules / name / NATIVE[pin.client] for name in names]
    return [p for p in found if p.is_file()]


def _command(client: str, binary: Path) -> list[str]:
    return [str(binary), "-m", MODULES[client]] if client in MODULES else [str(binary)]


def _answers_version(command: list[str], version: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="engram-agents-check-") as home:
        env = {**os.environ, "HOME": home, "CODEX_HOME": home, "XDG_CONFIG_HOME": home}
        try:
            done = subprocess.run(
                [*command, "--version"], env=env, capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0 and version in done.stdout


def _python_version(python: str) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = done.stdout.split()
    if done.returncode or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def find_python(accepted: tuple[tuple[int, int], ...]) -> str | None:
    """A Python of an ``accepted`` version with ``venv``: this one, else one on PATH."""
    candidates = [sys.executable] + [shutil.which(f"python{a}.{b}") or "" for a, b in accepted]
    for python in filter(None, candidates):
        if _python_version(python) in accepted:
            done = subprocess.run([python, "-c", "import venv, ensurepip"], capture_output=True)
            if done.returncode == 0:
                return python
    return None


def _pip_install(root: Path, pin: Pin) -> bool:
    """``pin``'s package from PyPI into its own virtualenv ``root/pypi/<client>``."""
    accepted = PYTHONS[pin.client]
    python = find_python(accepted)
    if python is None:
        versions = ", ".join(f"{a}.{b}" for a, b in accepted)
        print(f"agents: {pin.package} needs Python {versions}: none found", file=sys.stderr)
        return False
    venv = root / "pypi" / pin.client
    print(f"agents: pip install {pin.pypi}=={pin.version} ({python})", flush=True)
    if subprocess.run([python, "-m", "venv", str(venv)]).returncode:
        return False
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    pip += ["--no-input", "--quiet", f"{pin.pypi}=={pin.version}"]
    return subprocess.run(pip).returncode == 0


def find_agents(root: Path | None = None) -> Agents:
    """The installed clients: those the stamp names, or in an ``ENGRAM_AGENTS_DIR`` npm prefix
    without one, the best binary found there (versions then as pinned, unchecked)."""
    pins = read_pins()
    root = root or agents_dir(pins)
    stamp = root / STAMP
    if stamp.is_file():
        data = json.loads(stamp.read_text())
        binaries = {c: root / rel for c, rel in data["binaries"].items()}
        versions = {c: str(v).rsplit("@", 1)[-1] for c, v in data["pins"].items()}
    elif os.environ.get("ENGRAM_AGENTS_DIR"):
        found = {c: _candidates(root, pins[c]) for c in CLIENTS}
        binaries = {c: paths[0] for c, paths in found.items() if paths}
        versions = {c: pins[c].version for c in CLIENTS}
    else:
        raise AgentsMissing(f"the coding agents are not installed in {root}: run make agents-deps")
    if absent := [c for c in CLIENTS if c not in binaries or not binaries[c].is_file()]:
        what = ", ".join(f"{c} ({pins[c].package})" for c in absent)
        raise AgentsMissing(f"no {what} binary under {root}: run make agents-deps")
    return Agents(root, binaries, versions)


def _size(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for path in root.rglob("*"):
        st = path.lstat()
        if path.is_file() and not path.is_symlink() and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def install(pins_file: Path = PINS_FILE) -> int:
    """Install the pinned clients unless this pin set is already installed (0: done or no npm)."""
    pins = read_pins(pins_file)
    root = agents_dir(pins)
    if os.environ.get("ENGRAM_AGENTS_DIR"):
        try:
            found = find_agents(root)
        except AgentsMissing as exc:
            print(f"agents: {exc}", file=sys.stderr)
            return 1
        print(f"agents: ENGRAM_AGENTS_DIR={root}: {', '.join(map(str, found.binaries.values()))}")
        return 0
    if (root / STAMP).is_file():
        print(f"agents: {cache_name(pins)} already in {root.parent}")
        return 0
    npm = shutil.which("npm")
    if npm is None:
        print("note: no npm (Node.js): the coding-agent tests will skip (fail under CI=true)")
        return 0
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make` waits for the first
        if (root / STAMP).is_file():
            return 0
        partial = root.parent / f".{root.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted install left
        partial.mkdir()
        deps = {p.package: p.version for p in pins.values() if not p.pypi}
        manifest = {"name": "engram-test-agents", "private": True, "dependencies": deps}
        (partial / "package.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"agents: npm install {' '.join(f'{k}@{v}' for k, v in deps.items())}", flush=True)
        start = time.monotonic()
        flags = ["--no-audit", "--no-fund", "--ignore-scripts", "--prefer-offline"]
        flags += ["--no-update-notifier", "--engine-strict=false", "--loglevel=error"]
        if subprocess.run([npm, "install", *flags], cwd=partial).returncode:
            print("agents: npm install failed", file=sys.stderr)
            return 1
        seconds = time.monotonic() - start
        start = time.monotonic()
        for pin in pins.values():
            if pin.pypi and not _pip_install(partial, pin):
                print(f"agents: pip install {pin.pypi}=={pin.version} failed", file=sys.stderr)
                return 1
        pip_seconds = time.monotonic() - start
        chosen: dict[str, str] = {}
        for pin in pins.values():
            works = [
                b
                for b in _candidates(partial, pin)
                if _answers_version(_command(pin.client, b), pin.version)
            ]
            if not works:
                print(f"agents: no working {pin.client} binary in {partial}", file=sys.stderr)
                return 1
            chosen[pin.client] = str(works[0].relative_to(partial))
        size = _size(partial)
        stamp = {
            "pins": {c: f"{p.package}@{p.version}" for c, p in pins.items()},
            "binaries": chosen,
            "npm_seconds": round(seconds, 1),
            "pip_seconds": round(pip_seconds, 1),
            "bytes": size,
        }
        (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # the stamp last
        shutil.rmtree(root, ignore_errors=True)  # a folder without a stamp is not an install
        partial.rename(root)
    took = f"npm {seconds:.0f} s, pip {pip_seconds:.0f} s"
    print(f"agents: installed into {root} ({took}, {size / 2**20:.0f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in ([], ["install"]):
        return install()
    if args == ["where"]:
        try:
            found = find_agents()
        except AgentsMissing as exc:
            print(exc, file=sys.stderr)
            return 1
        for client in found.binaries:
            print(f"{client} {found.versions[client]} {' '.join(found.command(client))}")
        return 0
    print("usage: python -m testing.agents_install [install | where]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
