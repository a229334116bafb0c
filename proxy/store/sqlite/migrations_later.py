"""Migrations 7 onwards (:mod:`proxy.store.sqlite.migrations` lists them all, in order, and applies
them; its docstring fixes the schema's conventions). A migration, once released, never changes."""

from __future__ import annotations

import hashlib

from proxy.store.sqlite.db import Connection, driver
from proxy.store.vectable import MODEL_KEY, table_dim


def execute_script(conn: Connection, script: str) -> None:
    """Run ``script`` statement by statement inside the caller's transaction.

    ``executescript`` would COMMIT the open transaction first, breaking one-migration-one-
    transaction; trigger bodies hold semicolons, so split on complete statements.
    """
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if driver().module.complete_statement(pending):
            conn.execute(pending)
            pending = ""
    leftover = [ln for ln in pending.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    if leftover:
        raise ValueError(f"incomplete SQL statement in migration: {pending.strip()[:80]!r}")


def m007_session_names(conn: Connection) -> None:
    """``sessions.name``: the owner's id for the session, unique per user (see the module)."""
    execute_script(
        conn,
        """
        ALTER TABLE sessions ADD COLUMN name TEXT;
        UPDATE sessions SET name = id;
        """,
    )
    taken = {(str(u), str(n)) for u, n in conn.execute("SELECT user_id, name FROM sessions")}
    rows = conn.execute("SELECT id, user_id FROM sessions WHERE id LIKE '%~%'").fetchall()
    for sid, user in rows:
        base, _, suffix = str(sid).rpartition("~")
        mine = hashlib.sha256(str(user).encode()).hexdigest()[:8]
        if base and suffix == mine and (str(user), base) not in taken:
            conn.execute("UPDATE sessions SET name = ? WHERE id = ?", (base, sid))
            taken.add((str(user), base))
    execute_script(conn, "CREATE UNIQUE INDEX sessions_name ON sessions(user_id, name);")


def m008_api_keys(conn: Connection) -> None:
    """Engram's own API keys (``auth.mode = "keys"``): a key names its user; only a hash of
    its secret part is kept. Not tied to ``users`` by a foreign key: a key may be made for a
    user before that user has any memory, and forgetting a user's memory keeps their key."""
    execute_script(
        conn,
        """
        CREATE TABLE api_keys (
            id          TEXT PRIMARY KEY,       -- the public part, shown by `engram keys list`
            user_id     TEXT NOT NULL,
            secret_hash TEXT NOT NULL,          -- sha256 of the secret part, hex
            admin       INTEGER NOT NULL DEFAULT 0,
            label       TEXT NOT NULL DEFAULT '',
            created_at  REAL NOT NULL,
            revoked_at  REAL                    -- NULL while the key works
        );
        CREATE INDEX api_keys_user ON api_keys(user_id);
        """,
    )


def m009_forgetting(conn: Connection) -> None:
    """Deleting a session deletes what was derived from it: memory items made from it anywhere
    (a sub-agent's hand-back into its parent, facts) and the tool-result slots only it used."""
    execute_script(
        conn,
        """
        DROP TRIGGER sessions_ad_facts;
        -- Forgetting a session forgets every item distilled from it (hand-backs, facts).
        CREATE TRIGGER sessions_ad_items AFTER DELETE ON sessions BEGIN
            DELETE FROM turns WHERE source_session = old.id;
        END;
        -- Which session used which slot (no FK: its session may not be stored yet).
        CREATE TABLE slot_sessions (
            session_id TEXT NOT NULL,
            slot_id    TEXT NOT NULL,
            user_id    TEXT NOT NULL,
            expires_at REAL NOT NULL,
            PRIMARY KEY (session_id, slot_id)
        ) WITHOUT ROWID;
        CREATE INDEX slot_sessions_slot ON slot_sessions(user_id, slot_id);
        CREATE INDEX slot_sessions_expires ON slot_sessions(expires_at);

        CREATE TRIGGER users_ad_slot_sessions AFTER DELETE ON users BEGIN
            DELETE FROM slot_sessions WHERE user_id = old.id;
        END;
        """,
    )


def m010_turn_api(conn: Connection) -> None:
    """``turns.api``: the chat API a turn came through (``openai-chat``, ``anthropic``,
    ``openai-responses``, ``ollama``), shown by the admin API and the CLI; NULL for turns stored
    before, and for imported ones."""
    execute_script(conn, "ALTER TABLE turns ADD COLUMN api TEXT;")


def m011_embed_models(conn: Connection) -> None:
    """The model of every vector (:mod:`proxy.store.vectable`): ``embed_models`` lists the
    models (name, dimension); ``turns.embed_model`` is the model of the turn's vector, set with
    ``embed_hash``. The vectors already stored are the model ``meta`` names: its id is the new
    column's default, so no existing row is rewritten (a turn without a vector reads it too;
    ``embed_model`` means something only where ``embed_hash`` is set)."""
    execute_script(
        conn,
        """
        CREATE TABLE embed_models (
            id   INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,              -- as the embedder names it
            dim  INTEGER NOT NULL CHECK (dim > 0)
        );
        """,
    )
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (MODEL_KEY,)).fetchone()
    default = "NULL"
    if row is not None:
        cur = conn.execute(
            "INSERT INTO embed_models(name, dim) VALUES (?, ?)", (row[0], table_dim(conn))
        )
        default = str(int(cur.lastrowid or 0))
    # No REFERENCES: SQLite refuses a foreign-key column with a non-NULL default.
    conn.execute(f"ALTER TABLE turns ADD COLUMN embed_model INTEGER DEFAULT {default}")


def m012_scaffolds(conn: Connection) -> None:
    """Scaffolding stored once per user (:mod:`proxy.store.scaffolds`): what clients send again
    and again (system prompts, reminder and environment blocks, retries) is cut out of a turn's
    content into ``scaffolds``, by hash; ``turns.scaffold`` says where each piece stood.
    ``scaffold_sessions`` records which sessions used a piece (forgetting the last one forgets
    it) and ``paragraph_sightings`` which sessions sent a long paragraph (sent again in another
    session, it is scaffolding)."""
    execute_script(
        conn,
        """
        -- JSON [[at, hash, lead, trail], ...]: the pieces cut out of content, in order; NULL: none.
        ALTER TABLE turns ADD COLUMN scaffold TEXT;
        CREATE TABLE scaffolds (
            user_id    TEXT NOT NULL,
            hash       TEXT NOT NULL,           -- proxy.scaffold.digest of content
            kind       TEXT NOT NULL,           -- system, system-reminder, environment, retry, …
            content    TEXT NOT NULL,           -- redacted, without surrounding white space
            created_at REAL NOT NULL,
            last_seen  REAL NOT NULL,
            PRIMARY KEY (user_id, hash)
        ) WITHOUT ROWID;
        CREATE TABLE scaffold_sessions (
            user_id    TEXT NOT NULL,
            hash       TEXT NOT NULL,
            session_id TEXT NOT NULL,
            PRIMARY KEY (user_id, hash, session_id)
        ) WITHOUT ROWID;
        CREATE INDEX scaffold_sessions_session ON scaffold_sessions(session_id);
        CREATE TABLE paragraph_sightings (
            user_id    TEXT NOT NULL,
            hash       TEXT NOT NULL,
            session_id TEXT NOT NULL,
            PRIMARY KEY (user_id, hash, session_id)
        ) WITHOUT ROWID;
        CREATE INDEX paragraph_sightings_session ON paragraph_sightings(session_id);
        CREATE TRIGGER users_ad_scaffolds AFTER DELETE ON users BEGIN
            DELETE FROM scaffolds WHERE user_id = old.id;
            DELETE FROM scaffold_sessions WHERE user_id = old.id;
            DELETE FROM paragraph_sightings WHERE user_id = old.id;
        END;
        """,
    )


def m013_corrections(conn: Connection) -> None:
    """What a person corrects (:mod:`proxy.store.corrections`): ``turns.recall`` pins a turn
    (1: recalled into every chat of its user) or mutes it (-1: never recalled); a fact keeps
    the turn it was distilled from in ``source_turn`` (forgetting that turn forgets the fact)."""
    execute_script(
        conn,
        """
        ALTER TABLE turns ADD COLUMN recall INTEGER NOT NULL DEFAULT 0
            CHECK (recall IN (-1, 0, 1));
        ALTER TABLE turns ADD COLUMN source_turn INTEGER;
        CREATE INDEX turns_pinned ON turns(user_id, id) WHERE recall = 1;
        CREATE INDEX turns_source_turn ON turns(source_turn) WHERE source_turn IS NOT NULL;
        """,
    )


def m014_browse_indexes(conn: Connection) -> None:
    """Indexes the inspector's pages walk at 100,000 turns (``bench.inspector``): the user's
    pinned and muted turns (65 ms to 0.05 ms), and which chat APIs a session's turns came
    through (the sessions page's API filter: 36 ms to 3.5 ms)."""
    execute_script(
        conn,
        """
        CREATE INDEX turns_marked ON turns(user_id, id) WHERE recall != 0;
        CREATE INDEX turns_session_api ON turns(session_id, api) WHERE api IS NOT NULL;
        """,
    )


CHANGES_KEEP = 65_536
"""Rows of ``changes`` kept (migration 15): a process further behind reloads what it holds."""


def m015_changes(conn: Connection) -> None:
    """``changes``: the log through which processes sharing the database keep their in-memory
    search caches in step (:mod:`proxy.store.changes`). Triggers write a row in the transaction
    of each change those caches care about: a turn entering the full-text index (``indexed``),
    a turn altered or a session's ``indexed`` flipped (``changed``), a turn deleted (``deleted``,
    with its session: the in-memory views that showed it go too); vectors
    (``vector``) are logged by :func:`proxy.store.indexing.insert_vector`, ``turn_vec`` being a
    virtual table, which takes no trigger; ``turn_vec`` rebuilt logs a ``changed`` of every user
    (``user_id`` NULL). Ids only, never text. ``AUTOINCREMENT``: a sequence
    number is never reused once committed, so a gap below the oldest row means rows pruned."""
    execute_script(
        conn,
        f"""
        CREATE TABLE changes (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            user_id TEXT,  -- NULL: every user's
            turn_id INTEGER,
            kind TEXT NOT NULL CHECK (kind IN ('indexed', 'vector', 'changed', 'deleted')),
            session_id TEXT  -- of a deleted turn
        );
        CREATE TRIGGER changes_turn_inserted AFTER INSERT ON turns WHEN new.fts_pending = 0
        BEGIN
            INSERT INTO changes(user_id, turn_id, kind) VALUES (new.user_id, new.id, 'indexed');
        END;
        CREATE TRIGGER changes_turn_indexed AFTER UPDATE OF fts_pending ON turns
        WHEN old.fts_pending = 1 AND new.fts_pending = 0
        BEGIN
            INSERT INTO changes(user_id, turn_id, kind) VALUES (new.user_id, new.id, 'indexed');
        END;
        CREATE TRIGGER changes_turn_updated
        AFTER UPDATE OF user_id, session_id, position, role, speaker, content, timestamp ON turns
        BEGIN
            INSERT INTO changes(user_id, turn_id, kind) VALUES (old.user_id, old.id, 'changed');
            INSERT INTO changes(user_id, turn_id, kind)
                SELECT new.user_id, new.id, 'changed' WHERE new.user_id IS NOT old.user_id;
        END;
        CREATE TRIGGER changes_turn_deleted AFTER DELETE ON turns
        BEGIN
            INSERT INTO changes(user_id, turn_id, kind, session_id)
                VALUES (old.user_id, old.id, 'deleted', old.session_id);
        END;
        CREATE TRIGGER changes_session_indexed AFTER UPDATE OF indexed ON sessions
        WHEN old.indexed IS NOT new.indexed
        BEGIN
            INSERT INTO changes(user_id, turn_id, kind) VALUES (new.user_id, NULL, 'changed');
        END;
        CREATE TRIGGER changes_pruned AFTER INSERT ON changes WHEN new.seq % 1024 = 0
        BEGIN
            DELETE FROM changes WHERE seq <= new.seq - {CHANGES_KEEP};
        END;
        """,
    )


def m016_leases(conn: Connection) -> None:
    """``leases``: which process runs a background job on an item (a session's summary, a
    sub-agent's hand-back, a request's consolidation) when several share the database
    (:mod:`proxy.store.leases`); a lease its holder stops renewing expires."""
    execute_script(
        conn,
        """
        CREATE TABLE leases (
            name TEXT PRIMARY KEY,
            holder TEXT NOT NULL,
            expires_at REAL NOT NULL
        ) WITHOUT ROWID;
        """,
    )


PROMPT_BLOCKS_SQL = """
        CREATE TABLE prompt_blocks (
            user_id TEXT NOT NULL,
            chain TEXT NOT NULL,
            session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            turn_ids TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (user_id, chain, session_id)
        ) WITHOUT ROWID;
        CREATE INDEX prompt_blocks_session ON prompt_blocks(session_id);
        """


def m017_prompt_blocks(conn: Connection) -> None:
    """``prompt_blocks``: which memories were laid before which user message of a conversation,
    so later requests lay the same block again (:mod:`proxy.store.blocks`)."""
    execute_script(conn, PROMPT_BLOCKS_SQL)


SAID_SQL = """
        ALTER TABLE turns ADD COLUMN said_hash TEXT;
        CREATE INDEX turns_said ON turns(user_id, said_hash) WHERE said_hash IS NOT NULL;
        """


def m018_said(conn: Connection) -> None:
    """``turns.said_hash``: the hash over what was said through the turn (:mod:`proxy.said`),
    so a conversation a client resends otherwise than it sent it is still found; NULL for a
    turn that says nothing, and for turns stored before."""
    execute_script(conn, SAID_SQL)
