"""The bundled server as Engram's upstream (``engram serve`` with no model server found)."""

from __future__ import annotations

import asyncio
import time

from proxy.bundled.build import ensure_built
from proxy.bundled.cache import command_for
from proxy.bundled.flavours import SetupError, describe_exit
from proxy.bundled.smoke import _free_port, _healthy

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
