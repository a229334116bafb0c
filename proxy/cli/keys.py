"""``engram keys``: Engram's API keys (``auth.mode = "keys"``) and the admin token.

    engram keys create --user U [--admin] [--label TEXT]   the new key, alone on the last line
    engram keys list [--user U] [--json]                   id, user, admin, created, revoked
    engram keys revoke KEY_ID                              stops working within seconds
    engram keys admin-token                                the admin API's token (made if none)

Each opens the database directly (``--db``, ``--config``), like the other memory commands; the
key itself is shown once and only its hash is stored (:mod:`proxy.keys`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from proxy.auth import load_admin_token
from proxy.chat.identity import is_safe_id
from proxy.config import Settings
from proxy.keys import KEY_ID, new_admin_token, new_key
from proxy.paths import db_path, store_target
from proxy.store import queries
from proxy.store.backend import display
from proxy.store.keys import KeyRow, insert_key, list_keys, revoke_key
from proxy.store.store import Store


def add_parser(sub: Any, common: Any) -> None:
    """``engram keys`` and its subcommands (``common`` adds --config)."""
    keys: argparse.ArgumentParser = sub.add_parser("keys", help="Engram's API keys (auth.mode)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = ksub.add_parser(name, help=help)
        common(p)
        p.add_argument("--db", metavar="PATH", help="the memory database file")
        return p

    p = add("create", "make a key for a user; prints it once, alone on the last line")
    p.add_argument("--user", required=True, help="the user namespace the key acts as")
    p.add_argument("--admin", action="store_true", help="may use the admin API for any user")
    p.add_argument("--label", default="", help="a note to recognise the key by")
    p = add("list", "list keys (never the keys themselves)")
    p.add_argument("--user", help="only this user's keys")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add("revoke", "revoke a key by its id")
    p.add_argument("key_id", metavar="KEY_ID")
    add("admin-token", "print the admin API's token (generated at first use)")


def run(args: argparse.Namespace, settings: Settings) -> int:
    memory = settings.memory
    path = store_target(memory.backend, memory.postgres_url, memory.db_path)
    command = args.keys_command
    if command == "admin-token":
        print(asyncio.run(_admin_token(settings, path)))
        return 0
    if command == "create" and not is_safe_id(args.user):
        print(
            f"engram: --user {args.user!r}: use 1-200 letters, digits and . _ : @ / + = ~ -",
            file=sys.stderr,
        )
        return 2
    if command == "revoke" and not KEY_ID.fullmatch(args.key_id):
        print(f"engram: {args.key_id!r} is not a key id (12 hex digits)", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, settings, path))


async def _admin_token(settings: Settings, target: str | Path) -> str:
    """``memory.admin_token``; else the token file beside a SQLite database, or the one kept in
    a PostgreSQL database (as the server finds it: :func:`proxy.services._admin_token`)."""
    configured = settings.memory.admin_token
    if isinstance(target, Path) or configured:
        path = target if isinstance(target, Path) else db_path(settings.memory.db_path)
        return await asyncio.to_thread(load_admin_token, configured, path)
    from proxy.services import ADMIN_TOKEN_KEY  # imported late: the server's modules

    made = new_admin_token()
    async with Store(target) as store:
        return await store.write(lambda c: queries.shared_value(c, ADMIN_TOKEN_KEY, made))


async def _run(args: argparse.Namespace, settings: Settings, path: str | Path) -> int:
    async with Store(path) as store:
        if args.keys_command == "create":
            key = new_key()
            now = time.time()
            await store.write(
                lambda c: insert_key(
                    c, key.id, args.user, key.secret_hash, args.admin, args.label, now
                )
            )
            kind = "admin key" if args.admin else "key"
            print(f"created {kind} {key.id} for user {args.user!r} in {display(path)}")
            if settings.auth.mode != "keys":
                print("note: auth.mode is 'none'; set ENGRAM_AUTH_MODE=keys to require keys")
            print("the key is shown once; keep it now:")
            print(key.key)
            return 0
        if args.keys_command == "list":
            rows = await store.read(lambda c: list_keys(c, args.user))
            _print_keys(rows, args.json)
            return 0
        done = await store.write(lambda c: revoke_key(c, args.key_id, time.time()))
        if not done:
            print(f"engram: no working key {args.key_id!r}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
        return 0


def _print_keys(rows: list[KeyRow], as_json: bool) -> None:
    items = [
        {
            "id": r.id,
            "user": r.user_id,
            "admin": r.admin,
            "label": r.label,
            "created_at": r.created_at,
            "revoked_at": r.revoked_at,
        }
        for r in rows
    ]
    if as_json:
        print(json.dumps(items, indent=2))
        return
    for item in items:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(item["created_at"] or 0)))
        state = "revoked" if item["revoked_at"] is not None else "active"
        admin = " admin" if item["admin"] else ""
        print(f"{item['id']}  {item['user']}{admin}  {state}  created {when}  {item['label']}")
