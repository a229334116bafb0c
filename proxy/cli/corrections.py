"""The ``engram`` commands that correct memory, each one of :mod:`proxy.api.actions` (the functions
the admin API and the inspector use) followed by what a server would do afterwards, done here
before the command exits: the scrub that makes the deleted bytes leave the files, the tool-result
slots deleted from Redis.

    engram forget SESSION_ID [--user U]    a session and all it produced
    engram forget --turn ID [--user U]     one turn and what was made from it
    engram forget --user U --all --yes     all of a user's memory
    engram note TEXT [--user U]            a note, recalled like a turn (prints its id)
    engram fact edit ID TEXT [--user U]    a fact corrected (a new id)
    engram fact delete ID [--user U]
    engram pin ID / mute ID / unpin ID     always, never or as search finds it

Without ``--user`` a turn, note or fact is the ``default`` user's; a session is found by its name
across users. Another user's id is "not found", exactly like a missing one. Exit codes as
:mod:`proxy.cli.commands`: 0 done, 1 failed (nothing found, empty text), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from proxy.api import actions
from proxy.api import views as api
from proxy.config import Settings
from proxy.errors import BadRequest, EngramError
from proxy.search.embedder import Embedder
from proxy.search.model_check import ModelUnavailable, VectorsMismatch, usable_embedder
from proxy.slots.redis import forget_redis_slots, forget_redis_user
from proxy.store.corrections import RECALL_MODES
from proxy.store.naming import sessions_named
from proxy.store.store import Store

T = TypeVar("T")

RECALL_COMMANDS = {"pin": "pinned", "mute": "muted", "unpin": "normal"}
"""The command for each of ``turns.recall``'s values (unpin un-mutes too)."""
RECALL_SAYS = {
    "pinned": "recalled into every chat",
    "muted": "never recalled",
    "normal": "recalled when search finds it",
}


async def open_embedder(settings: Settings, store: Store) -> Embedder | None:
    """The configured embedder, or None (with a warning saying why and what to do) when it
    cannot be used here: it does not load, or the database's vectors are another model's."""
    try:
        return await usable_embedder(store, settings.embedder)
    except (ModelUnavailable, VectorsMismatch) as exc:
        print(f"engram: warning: working without vectors: {exc}", file=sys.stderr)
        return None


async def scrub(store: Store) -> None:
    """Make the deleted rows' bytes leave the files (FTS merge, vacuum, checkpoint; on
    PostgreSQL the tables rewritten) before the command exits."""
    report = await store.scrubber.scrub()
    if report is None:
        return
    if report.skipped:  # PostgreSQL: a table's lock never came
        print(
            f"engram: warning: {', '.join(report.skipped)} could not be rewritten (locked by "
            "another process's readers): the forgotten text may stay in their files until the "
            "next forget",
            file=sys.stderr,
        )
    elif not report.rewritten and not report.checkpointed:
        print(
            "engram: warning: the write-ahead log could not be emptied (another process is "
            "reading); it is when that process next checkpoints or stops",
            file=sys.stderr,
        )


def value(parse: Callable[..., T], *args: object) -> T:
    """A parameter checked as the admin API checks it; a bad one fails the command (exit 1),
    as a missing id does."""
    try:
        return parse(*args)
    except BadRequest as exc:
        raise EngramError(exc.message) from None


def _user(args: argparse.Namespace) -> str:
    return api.clean_user(args.user)


async def _with_embedder(
    settings: Settings, store: Store, act: Callable[[Embedder | None], Awaitable[T]]
) -> T:
    embedder = await open_embedder(settings, store)
    try:
        return await act(embedder)
    finally:
        if embedder is not None:
            await embedder.aclose()


# --- forget ---------------------------------------------------------------------------------------


async def forget(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    if sum((bool(args.session), args.turn is not None, args.all)) != 1:
        raise BadRequest(
            "give a SESSION_ID, --turn ID, or --user U --all (to delete a whole namespace)"
        )
    if args.all:
        return await forget_user(args, settings, store)
    if args.turn is not None:
        return await forget_turn(args, store)
    return await forget_session(args, settings, store)


async def forget_session(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    if args.user:
        user = _user(args)
    else:  # a session id is a name within its user: it must name one user's session
        found = await store.read(lambda c: sessions_named(c, args.session))
        if len(found) > 1:
            users = ", ".join(sorted(s.user_id for s in found))
            raise EngramError(f"users {users} each have a session {args.session!r}: give --user U")
        if not found:
            raise EngramError(f"no session {args.session!r}")
        user = found[0].user_id
    done = await actions.forget_session(store, user, args.session)
    await scrub(store)
    d = done.detail
    print(f"deleted session {d['id']!r} of user {user!r} ({d['turns']} turns)")
    slots = done.slot_ids
    if not slots or not settings.slots.redis_url:
        return 0
    if await forget_redis_slots(settings.slots, user, slots) is None:
        print(
            f"engram: warning: Redis is unreachable; {len(slots)} tool-result slots of the "
            "session expire there on their own (slots.ttl_seconds)",
            file=sys.stderr,
        )
    return 0


async def forget_user(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    if not args.user:
        raise BadRequest("use either SESSION_ID or --user U --all")
    user = _user(args)
    if user not in await store.list_users():
        raise EngramError(f"no user namespace {user!r}")
    if not args.yes:
        turns = (await store.stats()).per_user.get(user, 0)
        n = len(await store.list_sessions(user))
        print(
            f"engram: this deletes user {user!r}: {n} sessions, {turns} turns. Add --yes to do it.",
            file=sys.stderr,
        )
        return 2
    done = await actions.forget_everything(store, user)  # its embedded slots go with it
    await scrub(store)
    d = done.detail
    print(f"deleted user {user!r}: {d['sessions']} sessions, {d['turns']} turns")
    if settings.slots.redis_url:
        gone = await forget_redis_user(settings.slots, user)
        if gone is None:
            print(
                "engram: warning: Redis is unreachable; the user's tool-result slots there "
                "expire on their own (slots.ttl_seconds)",
                file=sys.stderr,
            )
        else:
            print(f"deleted {gone} tool-result slots from Redis")
    return 0


def _derived(done: actions.Done) -> str:
    d = done.detail["derived"]
    return (
        f"{d['facts']} facts, {d['summaries']} summaries, {d['handbacks']} hand-backs, "
        f"{d['requests']} request records"
    )


async def forget_turn(args: argparse.Namespace, store: Store) -> int:
    user, turn_id = _user(args), value(actions.parse_turn_id, args.turn, "--turn")
    done = await actions.forget_turn(store, user, turn_id)
    await scrub(store)
    print(
        f"deleted turn {turn_id} ({done.detail['role']}) of user {user!r}, and what was made "
        f"from it: {_derived(done)}"
    )
    return 0


# --- notes, facts, pins ---------------------------------------------------------------------------


async def note(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    """Store a note; prints its turn id (for ``engram pin``, ``engram forget --turn``)."""
    user, text = _user(args), value(actions.clean_text, args.text, "TEXT")
    redact_secrets = settings.memory.redact_secrets
    turn = await _with_embedder(
        settings,
        store,
        lambda e: actions.add_note(store, e, user, text, redact_secrets=redact_secrets),
    )
    print(turn.id)
    return 0


async def fact(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    user, fact_id = _user(args), value(actions.parse_turn_id, args.id, "ID")
    if args.action == "delete":
        await actions.delete_fact(store, user, fact_id)
        await scrub(store)
        print(f"deleted fact {fact_id} of user {user!r}")
        return 0
    text = value(actions.clean_text, args.text, "TEXT")
    redact_secrets = settings.memory.redact_secrets
    turn, _ = await _with_embedder(
        settings,
        store,
        lambda e: actions.edit_fact(store, e, user, fact_id, text, redact_secrets=redact_secrets),
    )
    await scrub(store)
    print(f"fact {fact_id} of user {user!r} is now fact {turn.id}: {turn.content}")
    return 0


async def recall(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    """``engram pin|mute|unpin ID``."""
    user, turn_id = _user(args), value(actions.parse_turn_id, args.id, "ID")
    mode = RECALL_COMMANDS[args.command]
    await actions.set_recall(store, user, turn_id, RECALL_MODES[mode])
    print(f"turn {turn_id} of user {user!r} is {mode} ({RECALL_SAYS[mode]})")
    return 0


COMMANDS = {"forget": forget, "note": note, "fact": fact, **dict.fromkeys(RECALL_COMMANDS, recall)}
"""The commands of this module, by name (:data:`proxy.cli.commands.COMMANDS` takes them in)."""
