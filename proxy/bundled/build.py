"""Building llama-server from the llama.cpp source vendored in the llama-cpp-python sdist, and
:func:`ensure_built`: the first flavour that is cached and verified here, else built, verified
and cached, falling back to the safe baseline when a flavour dies."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from proxy.bundled.cache import (
    _mark_failed,
    _mark_verified,
    _ready_binary,
    cache_root,
    failed_file,
    failure_here,
    flavour_binary,
    is_verified,
    model_path,
    override_binary,
    verified_file,
)
from proxy.bundled.flavours import (
    BINARY_ENV,
    CMAKE_OPTIONS,
    LLAMA_CPP_PYTHON_VERSION,
    Flavour,
    SetupError,
    SmokeTestFailed,
    candidate_flavours,
    cpu_model,
    cpu_tag,
    log,
)
from proxy.bundled.smoke import smoke_test

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
