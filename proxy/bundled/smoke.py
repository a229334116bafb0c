"""The smoke test: only running a binary proves that it runs on this CPU. Start it with the
real model and have it answer one real chat request."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from proxy.bundled.cache import command_for, model_path
from proxy.bundled.flavours import (
    SMOKE_READY_TIMEOUT_S,
    SMOKE_REQUEST_TIMEOUT_S,
    SmokeTestFailed,
    describe_exit,
    log,
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


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process (killed after 10 s) and reap it."""
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
            stop_process(proc)
    log(f"smoke test passed in {time.monotonic() - started:.1f} s: {binary} answered {content!r}")
    return content
