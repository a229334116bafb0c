"""Installs and finds Open WebUI, the chat app that ``tests/apps`` drives in a real browser, at the
version pinned in ``testing/openwebui.pins``, from PyPI, as its users install it
(``pip install open-webui``).

``python -m testing.openwebui_install`` (``make openwebui-deps``) makes a virtualenv with a
Python that Open WebUI accepts (3.11 or 3.12: this one, else ``python3.12`` / ``python3.11`` on
PATH) in ``${XDG_CACHE_HOME:-~/.cache}/engram/openwebui/<version>/`` and pip-installs the pinned
version there; torch as a CPU build when one is offered (a CPU wheel among pip's ``find-links``,
else PyTorch's CPU index when it answers), so the CUDA libraries (gigabytes) stay out. The
install counts only once that Open WebUI started offline from it and answered ``GET /health``:
then the stamp ``engram-openwebui.json`` (the version, the Python, the time pip took, the size)
is written, last, so an interrupted install never looks complete (the next run starts over).
A second install waits on a lock. ``ENGRAM_OPENWEBUI_DIR`` names another virtualenv holding
``open-webui`` to use instead (nothing is installed there). Without a suitable Python it says so
and succeeds: the Open WebUI tests then skip (fail under ``CI=true``).

Standard library only: the Makefile runs it before anything else is installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PINS_FILE = Path(__file__).with_name("openwebui.pins")
STAMP = "engram-openwebui.json"
PYTHONS = ((3, 12), (3, 11))  # what open-webui's Requires-Python (>=3.11,<3.13) allows
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
START_TIMEOUT_S = 300.0


class OpenWebUIMissing(RuntimeError):
    """The pinned Open WebUI is not installed; the message says what to do."""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str


@dataclass(frozen=True)
class OpenWebUI:
    """An installed Open WebUI: its virtualenv's Python and its version."""

    root: Path
    python: Path
    version: str


def read_pin(path: Path = PINS_FILE) -> Pin:
    pins: list[Pin] = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected '<package> <version>'")
        pins.append(Pin(*parts))
    if len(pins) != 1:
        raise ValueError(f"{path}: expected exactly one pin, found {len(pins)}")
    return pins[0]


def openwebui_dir(pin: Pin | None = None) -> Path:
    """``ENGRAM_OPENWEBUI_DIR``, else this version's folder in the cache."""
    if override := os.environ.get("ENGRAM_OPENWEBUI_DIR"):
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "engram" / "openwebui" / (pin or read_pin()).version


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


def find_python() -> str | None:
    """A Python that Open WebUI accepts, with ``venv``: this one, else one on PATH."""
    candidates = [sys.executable] + [shutil.which(f"python{a}.{b}") or "" for a, b in PYTHONS]
    for python in filter(None, candidates):
        if _python_version(python) in PYTHONS:
            done = subprocess.run([python, "-c", "import venv, ensurepip"], capture_output=True)
            if done.returncode == 0:
                return python
    return None


def _python_tag(python: str) -> str:
    version = _python_version(python)
    assert version is not None
    return f"cp{version[0]}{version[1]}"


def _find_links(pip: list[str]) -> list[Path]:
    """The local folders pip is told to look in for wheels (``PIP_FIND_LINKS``, pip's config)."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    done = subprocess.run([*pip, "config", "list"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += value.strip().strip("'\"").split()
    dirs = [Path(f.removeprefix("file://")) for f in found if "://" not in f or f[:7] == "file://"]
    return [d for d in dirs if d.is_dir()]


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status) < 400
    except (OSError, ValueError):
        return False


def torch_choice(pip: list[str], python_tag: str) -> tuple[list[str], str]:
    """pip arguments that get a CPU build of torch, and what they chose: a ``+cpu`` wheel in
    pip's find-links (pinned with a constraint), else PyTorch's CPU index when it answers, else
    nothing (torch from PyPI, with its CUDA libraries)."""
    pattern = re.compile(rf"torch-([^-]+\+cpu)-{python_tag}-{python_tag}-.*(x86_64|aarch64)\.whl")
    local = sorted(
        (m.group(1) for d in _find_links(pip) for f in d.iterdir() if (m := pattern.match(f.name))),
        key=lambda v: [int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", v)],
    )
    if local:
        constraints = Path(tempfile.mkdtemp(prefix="engram-openwebui-")) / "torch.txt"
        constraints.write_text(f"torch=={local[-1]}\n")
        return ["-c", str(constraints)], f"torch {local[-1]} (a local CPU wheel)"
    if _reachable(TORCH_CPU_INDEX + "/torch/"):
        return ["--extra-index-url", TORCH_CPU_INDEX], f"torch from {TORCH_CPU_INDEX}"
    return [], "torch from PyPI (no CPU build offered: with its CUDA libraries)"


def find_openwebui(root: Path | None = None) -> OpenWebUI:
    """The installed Open WebUI: the stamped install in the cache, or the virtualenv that
    ``ENGRAM_OPENWEBUI_DIR`` names (its version then read from the package, unchecked)."""
    pin = read_pin()
    root = root or openwebui_dir(pin)
    python = root / "bin" / "python"
    stamp = root / STAMP
    if stamp.is_file():
        version = str(json.loads(stamp.read_text())["version"])
    elif os.environ.get("ENGRAM_OPENWEBUI_DIR"):
        version = _installed_version(python) or ""
        if not version:
            raise OpenWebUIMissing(f"no {pin.package} in the virtualenv {root}")
    else:
        raise OpenWebUIMissing(
            f"Open WebUI {pin.version} is not installed in {root}: run make openwebui-deps"
        )
    if not python.exists():
        raise OpenWebUIMissing(f"no Python at {python}: run make openwebui-deps")
    return OpenWebUI(root, python, version)


def _installed_version(python: Path) -> str | None:
    code = "import importlib.metadata as m; print(m.version('open-webui'))"
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def offline_env(data_dir: Path, openai_base_url: str, port: int, **extra: str) -> dict[str, str]:
    """Open WebUI's environment for a run: everything it writes in ``data_dir``, nothing fetched
    from the internet (no model downloads, update checks or telemetry), Ollama off, the one
    OpenAI-compatible connection ``openai_base_url`` (ending in ``/v1``), sign-up open with new
    users active. ``extra`` adds or overrides settings (``ENABLE_FORWARD_USER_INFO_HEADERS``)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(data_dir / "home"),
        "TMPDIR": str(data_dir / "tmp"),
        "LANG": "C.UTF-8",
        "DATA_DIR": str(data_dir),
        "STATIC_DIR": str(data_dir / "static"),
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "WEBUI_SECRET_KEY": "engram-openwebui-test-secret",
        "WEBUI_URL": f"http://127.0.0.1:{port}",
        "WEBUI_AUTH": "true",
        "ENABLE_SIGNUP": "true",
        "DEFAULT_USER_ROLE": "user",
        # The connection's models for every user, not only the admin (as an admin does when
        # they make a model public in Admin Panel > Models).
        "BYPASS_MODEL_ACCESS_CONTROL": "true",
        "ENABLE_OLLAMA_API": "false",
        "ENABLE_OPENAI_API": "true",
        "OPENAI_API_BASE_URL": openai_base_url,
        "OPENAI_API_KEY": "sk-engram-test",
        # Offline: no Hugging Face downloads (embedding, reranking, whisper models), no update
        # check, no telemetry.
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(data_dir / "hf"),
        "SENTENCE_TRANSFORMERS_HOME": str(data_dir / "hf"),
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
        "WHISPER_MODEL_AUTO_UPDATE": "false",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "ENABLE_COMMUNITY_SHARING": "false",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
        "ANONYMIZED_TELEMETRY": "false",
        "ENABLE_OTEL": "false",
        "USER_AGENT": "engram-openwebui-test",
        "GLOBAL_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }
    for sub in ("home", "tmp", "static", "hf"):
        (data_dir / sub).mkdir(parents=True, exist_ok=True)
    return env | extra


def serve_command(python: Path, port: int) -> list[str]:
    """``open-webui serve`` (run through the virtualenv's Python: its scripts' first lines name
    the folder it was made in)."""
    code = "import sys; from open_webui import app; sys.argv[0] = 'open-webui'; app()"
    return [str(python), "-c", code, "serve", "--host", "127.0.0.1", "--port", str(port)]


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _answers_health(python: Path) -> tuple[bool, float, str]:
    """Start Open WebUI offline from ``python``'s virtualenv in a scratch data folder; whether
    it answered ``GET /health`` with 200, how long that took, and its log's tail."""
    with tempfile.TemporaryDirectory(prefix="engram-openwebui-check-") as tmp:
        port = free_port()
        env = offline_env(Path(tmp) / "data", "http://127.0.0.1:9/v1", port)
        log_path = Path(tmp) / "openwebui.log"
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                serve_command(python, port),
                env=env,
                cwd=tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            while time.monotonic() - start < START_TIMEOUT_S and proc.poll() is None:
                if health(f"http://127.0.0.1:{port}") == 200:
                    return True, time.monotonic() - start, ""
                time.sleep(0.5)
        finally:
            stop_group(proc)
        return False, time.monotonic() - start, log_path.read_text(errors="replace")[-3000:]


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """End a process started with ``start_new_session`` and everything it started."""
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.returncode is None:
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what it left running
        os.killpg(proc.pid, signal.SIGKILL)


def _size(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for path in root.rglob("*"):
        st = path.lstat()
        if path.is_file() and not path.is_symlink() and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def install() -> int:
    """Install the pinned Open WebUI unless it is already (0: done, or no suitable Python)."""
    pin = read_pin()
    root = openwebui_dir(pin)
    if os.environ.get("ENGRAM_OPENWEBUI_DIR"):
        try:
            found = find_openwebui(root)
        except OpenWebUIMissing as exc:
            print(f"openwebui: {exc}", file=sys.stderr)
            return 1
        print(f"openwebui: ENGRAM_OPENWEBUI_DIR={root}: open-webui {found.version}")
        return 0
    if (root / STAMP).is_file():
        print(f"openwebui: {pin.package} {pin.version} already in {root}")
        return 0
    python = find_python()
    if python is None:
        print(
            "note: no Python 3.11 or 3.12 with venv for Open WebUI: "
            "its tests will skip (fail under CI=true)"
        )
        return 0
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make` waits for the first
        if (root / STAMP).is_file():
            return 0
        # A folder without a stamp is what an interrupted install left. The virtualenv is made
        # in place: its scripts name the folder they were installed in.
        shutil.rmtree(root, ignore_errors=True)
        start = time.monotonic()
        if subprocess.run([python, "-m", "venv", str(root)]).returncode:
            print(f"openwebui: {python} -m venv {root} failed", file=sys.stderr)
            return 1
        venv_python = root / "bin" / "python"
        pip = [str(venv_python), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "--upgrade", "pip"])
        torch_args, torch_said = torch_choice(pip, _python_tag(python))
        spec = f"{pin.package}=={pin.version}"
        print(f"openwebui: pip install {spec} ({torch_said}) into {root}", flush=True)
        if subprocess.run([*pip, "install", "-q", *torch_args, spec]).returncode:
            print("openwebui: pip install failed", file=sys.stderr)
            return 1
        seconds = time.monotonic() - start
        ok, started_in, log = _answers_health(venv_python)
        if not ok:
            print(f"openwebui: it did not answer GET /health; its log ended:\n{log}")
            return 1
        size = _size(root)
        stamp = {
            "package": pin.package,
            "version": _installed_version(venv_python) or pin.version,
            "python": ".".join(map(str, _python_version(python) or ())),
            "torch": torch_said,
            "pip_seconds": round(seconds, 1),
            "first_start_seconds": round(started_in, 1),
            "bytes": size,
        }
        (root / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # the stamp last
    print(
        f"openwebui: installed {spec} into {root} (pip {seconds:.0f} s, {size / 2**20:.0f} MiB; "
        f"first start {started_in:.0f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in ([], ["install"]):
        return install()
    if args == ["where"]:
        try:
            found = find_openwebui()
        except OpenWebUIMissing as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"open-webui {found.version} {found.python}")
        return 0
    print("usage: python -m testing.openwebui_install [install | where]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
