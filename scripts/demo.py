#!/usr/bin/env python3
"""A short scripted chat that shows Engram recalling a fact in a new conversation.

    python -m scripts.demo                       # uses Engram at 127.0.0.1:8787, else starts one
    python -m scripts.demo --url http://127.0.0.1:9000

Run it from the repository root. With no Engram running, it starts `python -m proxy serve` (this
checkout's Engram) with a throw-away database (and, with no model server around, Engram starts
its bundled tiny model). The official openai SDK is the client: nothing here knows about Engram
except the base URL and a user header.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from openai import OpenAI

USER = "demo-user"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
FACT = "Hi! I'm Ada. I keep three beehives on my balcony in Lyon."
QUESTION = "Remind me: where do I keep my beehives?"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/engram/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn() -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    db = Path(tempfile.mkdtemp(prefix="engram-demo-")) / "demo.db"
    print(f"starting engram serve on port {port} with a throw-away database {db} ...")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--db", str(db)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # the first start may build llama-server
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("engram serve did not start; see its log above")
        time.sleep(0.5)
    token = Path(str(db) + ".admin-token").read_text().strip()  # made at first start
    return proc, url, token


def say(client: OpenAI, messages: list[dict[str, str]]) -> tuple[str, dict[str, str]]:
    raw = client.chat.completions.with_raw_response.create(
        model="demo",
        messages=messages,
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
        extra_headers={"X-Engram-User": USER},
    )
    reply = raw.parse().choices[0].message.content or ""
    return reply.strip(), {k.lower(): v for k, v in raw.headers.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8787")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("ENGRAM_ADMIN_TOKEN", ""),
        help="the running server's admin token (`engram keys admin-token` prints it)",
    )
    args = parser.parse_args()
    proc = None
    url = args.url.rstrip("/")
    token = args.admin_token
    if not healthy(url):
        proc, url, token = spawn()
    try:
        client = OpenAI(base_url=url + "/v1", api_key="not-needed")
        print(f"\n— conversation 1 —\nuser: {FACT}")
        reply, _ = say(
            client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FACT}]
        )
        print(f"assistant: {reply}")
        time.sleep(1.0)  # archiving happens in the background, after the reply
        print(f"\n— conversation 2 (a new chat; the client sends no history) —\nuser: {QUESTION}")
        reply, headers = say(
            client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        )
        print(f"assistant: {reply}")
        session = headers.get("x-engram-session", "")
        print(
            f"\nEngram injected {headers.get('x-engram-memories', '0')} memories "
            f"(session {session}, prompt tokens forwarded/original "
            f"{headers.get('x-engram-prompt-tokens', '?')})."
        )
        req = urllib.request.Request(
            f"{url}/engram/api/sessions/{session}/requests/last",
            headers={"X-Engram-User": USER, "Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            last = json.load(r)
        system = last["parts"][0]["message"]["content"]
        print("\nThe system message the model received:\n" + "-" * 60)
        print(system if isinstance(system, str) else json.dumps(system, indent=2))
        print("-" * 60)
        recalled = "Lyon" in json.dumps(last)
        print(
            "\nThe fact from conversation 1 was recalled."
            if recalled
            else "\nThe fact was NOT recalled."
        )
        return 0 if recalled else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
