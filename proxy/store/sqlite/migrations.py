"""The schema, as numbered migrations recorded in ``schema_migrations``.

:func:`migrate` applies every migration newer than the database, each in its own
``BEGIN IMMEDIATE`` transaction, and records ``(version, applied_at)``. A migration, once
released, never changes: a schema change is a new function appended to :data:`MIGRATIONS`.

Conventions the schema fixes (migration 1):

- Times (``created_at``, ``last_seen``, ``turns.timestamp``, ``applied_at``) are REAL Unix
  seconds (UTC), so they sort, subtract and compare without parsing.
- ``turns`` is the archive: one row per message, ``UNIQUE(session_id, position)``. JSON columns
  (``tool_calls``) hold JSON text.
- ``turns_fts`` is a contentless FTS5 index (``content=''``, ``contentless_delete=1``, so the
  text is stored once, in ``turns``) keyed by ``rowid = turns.id``, with three columns:
  ``body`` = ``"<speaker or role>: <content>"`` (as :func:`proxy.store.models.index_text`),
  ``ctx`` = the bodies of up to ``CTX_TURNS`` turns before and after it in its session
  (position order, system turns left out, each cut to ``CTX_CHARS`` characters, joined by
  newlines; both in :mod:`proxy.store.sqlite.fts_sql`; empty for a system turn) and ``date`` = the
  turn's UTC date as words, e.g. ``"Monday 8 May 2023"``. On LoCoMo the neighbours and the date
  lift FTS recall@10 from 0.61 to 0.73: answers often sit in the turn next to the one that names the
  topic. The ``turns_ai`` / ``turns_au`` / ``turns_ad`` triggers keep it in step, rewriting the
  ``ctx`` of the neighbours whose window a turn enters or leaves. Rank with ``bm25(turns_fts, body,
  ctx, date)`` weights (:data:`proxy.store.sqlite.search_sql.FTS_WEIGHTS`). Being contentless, it
  cannot return
  text: ``highlight()``/``snippet()`` do not work; read ``turns``. Its tokenizer is
  :data:`FTS_TOKENIZE`. Changing the constant, the columns or the trigger expressions changes only
  databases created afterwards; an existing database needs a new migration that recreates
  ``turns_fts`` and its triggers and re-inserts every turn (``INSERT INTO turns_fts(rowid, body,
  ctx, date) SELECT ... FROM turns``). ``contentless_delete`` needs SQLite 3.43 or newer
  (:func:`proxy.store.sqlite.db.driver` picks a driver that has it). ``turns_fts_terms`` is its
  ``fts5vocab`` (``row``): how many rows hold each term.
- ``turn_vec`` is a sqlite-vec ``vec0`` table keyed by ``turn_id`` (= ``turns.id``), partitioned
  by ``user_id`` so a KNN scans one namespace's vectors only, with ``session_id`` and
  ``indexed`` metadata columns for filtering inside the KNN. ``embedding_bits`` is the sign-bit
  quantisation of ``embedding`` (``vec_quantize_binary``, 48 bytes): large namespaces are searched
  by Hamming distance first and the candidates re-scored by exact cosine. ``turns_ad`` deletes a
  turn's vector with it (a virtual table cannot be the child of a foreign key).
  ``turn_vec.indexed`` copies ``sessions.indexed``; no trigger can keep it in step (sqlite-vec
  0.1.9 refuses an UPDATE that is not a point lookup by ``turn_id``), so the store updates both.
- ``turns.embed_hash`` is the hash of the exact text a turn's vector was computed from; a new
  turn whose text was embedded before reuses that vector instead of embedding it again.
- ``meta`` holds key/value facts about the database (e.g. the embedding model of ``turn_vec``).
- Migration 4 (the feedback loop): ``requests`` records recent chat requests (pruned in the
  background), ``feedback`` and ``consolidation_queue`` hang off them by ``request_id``
  (cascade), ``counters`` holds running token totals, and the ``sessions_ad_facts`` trigger
  deletes the facts (``role = 'fact'``) whose ``source_session`` is deleted.
- Migration 5 (tool-result slots, :mod:`proxy.slots.embedded`, SQL in :mod:`proxy.store.slots`):
  ``slots`` holds one row per ``(user_id, id)`` with the tool output and its ``expires_at`` (REAL
  Unix seconds; a row past it is expired: never read, deleted by the periodic purge). It is an
  ordinary rowid table, not ``WITHOUT ROWID``: tool outputs are large rows, which ``WITHOUT ROWID``
  tables store badly. ``user_id`` has no foreign key (a slot may be stored before its user's first
  turn is archived); the ``users_ad_slots`` trigger deletes a user's slots with the user instead.
- Migration 6 (archive first, index after): ``turns.fts_pending`` (0/1). A chat turn is inserted
  with 1 in the transaction that ends its reply, so the insert trigger skips it;
  :func:`proxy.store.indexing.index_deferred` gives it its ``turns_fts`` row (and rewrites its
  neighbours' ``ctx``) in the background, as the trigger would have. Partial indexes find the
  turns still waiting for that (``turns_fts_pending``) or for a vector (``turns_unembedded``).
- Migration 7 (sessions keyed by owner): ``sessions.name`` is the id the owner's client knows
  the session by, unique per user (``sessions_name``: ``UNIQUE(user_id, name)``); ``sessions.id``
  stays the global key every other table refers to, and is never looked up from what a client
  sends (see :mod:`proxy.store.naming`). Existing sessions keep their id as their name, except
  the ones an older Engram scoped for a user because another user held the name (``<name>~<first
  8 hex of sha256(user)>``, owned by that user): they get back the name the client sent.
- Migration 9 (forgetting, :mod:`proxy.store.forget`): ``sessions_ad_items`` deletes every item
  derived from a deleted session (hand-backs too, not only facts); ``slot_sessions`` links slots to
  the sessions that used them. :func:`migrate` then sets ``auto_vacuum = INCREMENTAL``
  (:func:`proxy.store.sqlite.scrub.ensure_incremental_vacuum`; a one-time ``VACUUM`` for older
  files).
- Migration 11 (the model of every vector, :mod:`proxy.store.vectable`): ``embed_models`` and
  ``turns.embed_model``, written with ``embed_hash``. ``turn_vec`` takes the dimension of its
  model: :data:`EMBED_DIM` is only that of a new database's table.
- Migration 12 (scaffolding, :mod:`proxy.store.scaffolds`): ``scaffolds`` holds each piece of
  scaffolding once per user by hash, ``turns.scaffold`` where a turn's pieces stood in its
  words, ``scaffold_sessions`` and ``paragraph_sightings`` which sessions sent what. Turns stored
  before keep their content whole (recall reads their words by shape).
- Migration 15 (processes sharing one database, :mod:`proxy.store.changes`): ``changes`` logs,
  by trigger in the changing transaction, the ids of what the in-memory search caches hold that
  changed (``indexed``, ``vector``, ``changed``); the last ``CHANGES_KEEP`` rows are kept.
- Migration 16 (jobs shared by those processes, :mod:`proxy.store.leases`): ``leases`` holds who
  runs the background job on an item, until when.
- Migration 17 (a prompt whose prefix never moves, :mod:`proxy.store.blocks`): ``prompt_blocks``
  holds which memories were laid before which user message of a session.
- Migration 18 (a conversation resent otherwise, :mod:`proxy.said`): ``turns.said_hash``, the
  hash over what was said through each turn, indexed by user.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.store.sqlite import migrations_later as later
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.fts_sql import fts_insert_trigger_sql, fts_triggers_sql
from proxy.store.sqlite.migrations_later import execute_script as _execute_script
from proxy.store.sqlite.scrub import ensure_incremental_vacuum

FTS_TOKENIZE = "porter unicode61 remove_diacritics 2"
"""FTS5 tokenizer of ``turns_fts`` in new databases."""

EMBED_DIM = 384
"""Vector length of ``turn_vec.embedding`` in a new database (the default model's); the table is
rebuilt for the dimension of the model it holds (:mod:`proxy.store.vectable`)."""


def _m001_initial(conn: Connection) -> None:
    _execute_script(
        conn,
        f"""
        CREATE TABLE meta (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );

        CREATE TABLE users (
            id         TEXT PRIMARY KEY,         -- the user namespace
            created_at REAL NOT NULL
        );

        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            parent_id   TEXT REFERENCES sessions(id) ON DELETE CASCADE,
            level       INTEGER NOT NULL DEFAULT 0 CHECK (level >= 0),
            agent       TEXT,
            created_at  REAL NOT NULL,
            last_seen   REAL NOT NULL,
            fingerprint TEXT,
            -- 1: the session's turns are found by searches over all of the user's memory;
            -- 0: only by searches naming the session (e.g. a sub-agent's raw history).
            indexed     INTEGER NOT NULL DEFAULT 1 CHECK (indexed IN (0, 1))
        );
        CREATE INDEX sessions_user ON sessions(user_id, last_seen);
        CREATE INDEX sessions_parent ON sessions(parent_id);
        CREATE INDEX sessions_fingerprint ON sessions(user_id, fingerprint);

        CREATE TABLE turns (
            id           INTEGER PRIMARY KEY,
            session_id   TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            user_id      TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            -- messages: 0, 1, 2… in conversation order; memory items Engram makes (role
            -- 'summary' or 'fact') take -1, -2…, so they never collide with a message.
            position     INTEGER NOT NULL CHECK (position >= 0 OR role IN ('summary', 'fact')),
            role         TEXT NOT NULL,
            speaker      TEXT,                   -- the message's "name", or a display name
            content      TEXT NOT NULL DEFAULT '',
            tool_calls   TEXT,                   -- JSON array, as the message carried it
            tool_call_id TEXT,
            timestamp    REAL NOT NULL,          -- Unix seconds
            token_count  INTEGER,
            content_hash TEXT NOT NULL,          -- identity of the message (see store.models)
            embed_hash   TEXT,                   -- hash of the text its vector came from
            incomplete   INTEGER NOT NULL DEFAULT 0 CHECK (incomplete IN (0, 1)),
            UNIQUE (session_id, position)
        );
        CREATE INDEX turns_user ON turns(user_id, id);
        CREATE INDEX turns_user_hash ON turns(user_id, content_hash);
        CREATE INDEX turns_embed_hash ON turns(embed_hash) WHERE embed_hash IS NOT NULL;

        CREATE VIRTUAL TABLE turns_fts USING fts5(
            body, ctx, date,
            content = '', contentless_delete = 1,
            tokenize = '{FTS_TOKENIZE}'
        );
        -- How many rows hold each indexed term (for leaving very common words out of queries).
        CREATE VIRTUAL TABLE turns_fts_terms USING fts5vocab(turns_fts, row);

        CREATE VIRTUAL TABLE turn_vec USING vec0(
            turn_id   INTEGER PRIMARY KEY,
            user_id   TEXT PARTITION KEY,
            embedding FLOAT[{EMBED_DIM}] DISTANCE_METRIC=cosine,
            embedding_bits BIT[{EMBED_DIM}],
            session_id TEXT,
            indexed   INTEGER
        );

        {fts_triggers_sql()}
        """,
    )


def _m002_summaries(conn: Connection) -> None:
    """One rolling summary per session, with the range of turns it covers."""
    _execute_script(
        conn,
        """
        CREATE TABLE summaries (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            content    TEXT NOT NULL,
            upto       INTEGER NOT NULL,     -- covers the session's turns at positions < upto
            tokens     INTEGER NOT NULL,
            model      TEXT,
            updated_at REAL NOT NULL
        );
        """,
    )


def _m003_items_and_completion(conn: Connection) -> None:
    """Memory items link to the session they came from; sub-agent sessions can be completed."""
    _execute_script(
        conn,
        """
        ALTER TABLE turns ADD COLUMN source_session TEXT;
        ALTER TABLE sessions ADD COLUMN completed_at REAL;
        CREATE INDEX turns_source ON turns(source_session) WHERE source_session IS NOT NULL;
        """,
    )


def _m004_feedback(conn: Connection) -> None:
    """The feedback loop: recent chat requests, feedback on them, the consolidation queue, token
    counters that outlive the process; facts go with the session they were distilled from."""
    _execute_script(
        conn,
        """
        -- One row per chat request (kept for feedback.keep_days / feedback.keep_requests).
        CREATE TABLE requests (
            id          TEXT PRIMARY KEY,       -- X-Engram-Request-Id
            user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            session_id  TEXT REFERENCES sessions(id) ON DELETE CASCADE,
            model       TEXT,
            query       TEXT NOT NULL,          -- the last user message, redacted
            memory_ids  TEXT NOT NULL DEFAULT '[]',  -- JSON array of injected turn ids
            created_at  REAL NOT NULL
        );
        CREATE INDEX requests_user ON requests(user_id, created_at);
        CREATE INDEX requests_session ON requests(session_id);
        CREATE INDEX requests_time ON requests(created_at);

        CREATE TABLE feedback (
            id          INTEGER PRIMARY KEY,
            request_id  TEXT NOT NULL REFERENCES requests(id) ON DELETE CASCADE,
            user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            helpful     INTEGER NOT NULL CHECK (helpful IN (0, 1)),
            source      TEXT NOT NULL,          -- 'api', or what flagged it (e.g. 'expired_slot')
            note        TEXT,
            created_at  REAL NOT NULL
        );
        CREATE INDEX feedback_request ON feedback(request_id);
        CREATE INDEX feedback_user ON feedback(user_id);

        CREATE TABLE consolidation_queue (
            request_id  TEXT PRIMARY KEY REFERENCES requests(id) ON DELETE CASCADE,
            user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            status      TEXT NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'done', 'failed')),
            attempts    INTEGER NOT NULL DEFAULT 0,
            facts       INTEGER NOT NULL DEFAULT 0,   -- new facts stored for it
            error       TEXT,                         -- why the last try failed
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL
        );
        CREATE INDEX consolidation_status ON consolidation_queue(status, updated_at);
        CREATE INDEX consolidation_user ON consolidation_queue(user_id, status);

        -- Running totals (tokens proxied, spent on summaries, on consolidation), added to by
        -- every process that serves this database.
        CREATE TABLE counters (
            name  TEXT PRIMARY KEY,
            value INTEGER NOT NULL DEFAULT 0
        );

        -- Forgetting a session forgets the facts distilled from it.
        CREATE TRIGGER sessions_ad_facts AFTER DELETE ON sessions BEGIN
            DELETE FROM turns WHERE role = 'fact' AND source_session = old.id;
        END;
        """,
    )


def _m005_slots(conn: Connection) -> None:
    """Tool-result slots kept in the SQLite file (when Redis is not configured or is down)."""
    _execute_script(
        conn,
        """
        CREATE TABLE slots (
            user_id     TEXT NOT NULL,          -- the user namespace (no FK: see users_ad_slots)
            id          TEXT NOT NULL,          -- the deterministic slot id
            tool        TEXT NOT NULL DEFAULT '',
            description TEXT NOT NULL DEFAULT '',
            content     TEXT NOT NULL,
            tokens      INTEGER NOT NULL DEFAULT 0,
            bytes       INTEGER NOT NULL DEFAULT 0,   -- UTF-8 length of content
            created_at  REAL NOT NULL,
            expires_at  REAL NOT NULL,          -- refreshed whenever the slot is stored or read
            PRIMARY KEY (user_id, id)
        );
        CREATE INDEX slots_expires ON slots(expires_at);

        -- Forgetting a user forgets their slots.
        CREATE TRIGGER users_ad_slots AFTER DELETE ON users BEGIN
            DELETE FROM slots WHERE user_id = old.id;
        END;
        """,
    )


def _m006_deferred_index(conn: Connection) -> None:
    """Chat turns are archived the moment a reply ends, and indexed afterwards in the background
    (``proxy.background.indexer``): a turn inserted with ``fts_pending = 1`` skips the insert
    trigger; the
    turns still waiting for their full-text row (``fts_pending = 1``) or their vector
    (``embed_hash IS NULL``) are what the indexer replays at start."""
    _execute_script(
        conn,
        f"""
        ALTER TABLE turns ADD COLUMN fts_pending INTEGER NOT NULL DEFAULT 0;
        CREATE INDEX turns_unembedded ON turns(id) WHERE embed_hash IS NULL;
        CREATE INDEX turns_fts_pending ON turns(id) WHERE fts_pending = 1;
        DROP TRIGGER turns_ai;
        {fts_insert_trigger_sql(when="new.fts_pending = 0")}
        """,
    )


Migration = Callable[[Connection], None]

MIGRATIONS: tuple[tuple[int, Migration], ...] = (
    (1, _m001_initial),
    (2, _m002_summaries),
    (3, _m003_items_and_completion),
    (4, _m004_feedback),
    (5, _m005_slots),
    (6, _m006_deferred_index),
    (7, later.m007_session_names),
    (8, later.m008_api_keys),
    (9, later.m009_forgetting),
    (10, later.m010_turn_api),
    (11, later.m011_embed_models),
    (12, later.m012_scaffolds),
    (13, later.m013_corrections),
    (14, later.m014_browse_indexes),
    (15, later.m015_changes),
    (16, later.m016_leases),
    (17, later.m017_prompt_blocks),
    (18, later.m018_said),
)
"""(version, function), ascending. Append only."""


def _ensure_table(conn: Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
    )


def applied_versions(conn: Connection) -> list[int]:
    """Versions recorded in ``schema_migrations``, ascending (empty for a blank database)."""
    if getattr(conn, "dialect", "sqlite") == "postgres":
        from proxy.store.postgres.migrate import applied_versions as pg_versions

        return pg_versions(conn)
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()
    if exists is None:
        return []
    return [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]


def latest_version() -> int:
    return MIGRATIONS[-1][0]


def migrate(conn: Connection) -> list[int]:
    """Apply pending migrations, one transaction each; returns the versions applied.

    ``conn`` must be in autocommit mode (as :func:`proxy.store.sqlite.db.connect` opens it).
    A database newer than this code raises ``RuntimeError`` rather than being touched.
    """
    if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
        ensure_incremental_vacuum(conn)  # a new database: set before its first table
    _ensure_table(conn)
    done = set(applied_versions(conn))
    if done and max(done) > latest_version():
        raise RuntimeError(
            f"database schema version {max(done)} is newer than this Engram "
            f"(knows up to {latest_version()}); upgrade Engram"
        )
    applied: list[int] = []
    for version, fn in MIGRATIONS:
        if version in done:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while we waited for the write lock.
            if conn.execute(
                "SELECT 1 FROM schema_migrations WHERE version = ?", (version,)
            ).fetchone():
                conn.execute("COMMIT")
                continue
            fn(conn)
            conn.execute(
                "INSERT INTO schema_migrations(version, applied_at) VALUES (?, ?)",
                (version, time.time()),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(version)
    ensure_incremental_vacuum(conn)  # an older database: vacuumed once
    return applied
