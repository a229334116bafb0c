"""The settings model: every option declared once, with its default, type, limits and help.

Layers, later ones win: the defaults declared here (rendered verbatim into
``config/engram.toml``), a user TOML file (``--config``), ``ENGRAM_<SECTION>_<KEY>`` environment
variables, then command-line flags. Unknown keys and bad values raise :class:`ConfigError` with a
message that names the key, where it came from and what is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "ENGRAM_"
# Environment variables with the prefix that are not settings.
_ENV_NOT_SETTINGS = frozenset({"ENGRAM_CONFIG", "ENGRAM_WORKER"})  # the file; a worker's number


class ConfigError(ValueError):
    """A setting is unknown or has a value outside what it accepts."""


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    pattern: str | None = None,
) -> Any:
    """Declare one setting: its default and a one-line description (plus limits; ``pattern``:
    a regular expression a string value must match whole)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "pattern": pattern}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerSettings:
    """[server] — the HTTP listener."""

    host: str = opt("127.0.0.1", "Address to bind. A non-loopback address also needs allow_remote.")
    port: int = opt(8787, "TCP port to listen on.", min=0, max=65535)
    workers: int = opt(
        1,
        "Processes serving the port (Linux SO_REUSEPORT: the kernel spreads connections over "
        "them). Each holds its own search caches, kept in step through the database; more "
        "than 1 needs a fixed port.",
        min=1,
        max=64,
    )
    allow_remote: bool = opt(
        False, "Allow binding a non-loopback address (exposes your memory to the network)."
    )
    allowed_hosts: list[str] = opt(
        [],
        "Extra Host header names to accept besides the bound host and loopback names "
        "(DNS-rebinding protection).",
    )
    cors_origins: list[str] = opt(
        [],
        "Web origins (scheme://host[:port], e.g. http://localhost:3000) trusted to call the "
        "chat and pass-through routes from a browser: they get CORS headers, and no other web "
        "page may send Engram anything but GET. Never applies to /engram/. Empty: only "
        'Engram\'s own origin and non-browser clients. "*" (any page) is refused while '
        "memory.enabled is true.",
        pattern=r"\*|null|[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+",
    )
    max_body_bytes: int = opt(
        64 * 1024 * 1024, "Largest request body accepted; larger ones get a 413.", min=1024
    )
    shutdown_timeout: float = opt(
        30.0, "Seconds to let in-flight requests and background work finish on shutdown.", min=0
    )
    log_level: str = opt("info", "Log level.", choices=("debug", "info", "warning", "error"))
    log_format: str = opt("text", "Log line format.", choices=("text", "json"))
    access_log: bool = opt(
        False,
        "Log one line per request (method, path, status, duration); costs about a fifth "
        "of peak throughput.",
    )
    event_loop: str = opt(
        "auto",
        "Event loop: uvloop where installed (faster), else asyncio's own.",
        choices=("auto", "uvloop", "asyncio"),
    )


@dataclass(frozen=True)
class AuthSettings:
    """[auth] — who may use Engram, and as which user."""

    mode: str = opt(
        "none",
        "none: no accounts; the user comes from identity headers or the client's key, and "
        "Engram binds loopback only (a laptop). keys: every request needs one of Engram's keys "
        "(Authorization: Bearer or x-api-key; `engram keys create --user NAME`), whose user "
        "it is; identity headers cannot override it (a shared server).",
        choices=("none", "keys"),
    )
    trusted_proxy_secret: str = opt(
        "",
        "A front-end that authenticates its own users (Open WebUI and the like) sends this as "
        "its API key; its requests' identity headers (X-OpenWebUI-User-Id, X-Engram-User) then "
        "choose the user. Empty: no front-end is trusted. At least 32 characters.",
        pattern=r"|\S{32,}",
    )
    loopback_admin: bool = opt(
        False,
        "Let loopback clients use the admin API without the admin token (auth.mode = none "
        "only). Off: a same-host reverse proxy or another local user's program cannot.",
    )


@dataclass(frozen=True)
class UpstreamSettings:
    """[upstream] — the model server Engram forwards to."""

    url: str = opt(
        "",
        "Base URL of the model server, e.g. http://127.0.0.1:8080. Empty: auto-detect "
        "llama.cpp on 127.0.0.1:8080, then Ollama on 127.0.0.1:11434.",
    )
    kind: str = opt(
        "auto",
        "What the upstream is, for context-size discovery.",
        choices=("auto", "llamacpp", "ollama", "openai"),
    )
    connect_timeout: float = opt(
        10.0,
        "Seconds to wait for a TCP connection to the upstream. Generations themselves "
        "have no total timeout.",
        min=0.1,
    )
    probe_timeout: float = opt(
        2.0, "Seconds each auto-detection and health probe may take.", min=0.1
    )
    context_size: int = opt(
        0,
        "The upstream's context window in tokens; 0 discovers it (llama.cpp /props, "
        "Ollama /api/show).",
        min=0,
    )
    bundled: bool = opt(
        True,
        "With no upstream configured or found, start the bundled tiny model (SmolLM2-135M "
        "on llama.cpp's llama-server, built once and cached) so Engram can be tried at once.",
    )
    max_connections: int = opt(
        256, "Most simultaneous connections to the upstream (0 = no limit).", min=0
    )
    api_key: str = opt(
        "",
        "Key sent to the upstream as Authorization: Bearer, in place of whatever credential "
        "the client sent (with auth.mode = keys the client's key is Engram's and never goes "
        "upstream). Empty: the client's own Authorization is forwarded (mode none) or none is.",
    )
    own_calls_idle: float = opt(
        5.0,
        "Engram's own calls to the model (summaries, sub-agent hand-backs, consolidation) "
        "start only when no request to the upstream is in flight through this process and "
        "none has ended for this many seconds: on a one-slot model server they would make the "
        "user's next turn wait for them and may evict its cached prompt. Agent loops send "
        "their next turn the instant a reply ends; a person reads and types for longer. "
        "0: as soon as nothing is in flight.",
        min=0,
    )
    own_calls_max_wait: float = opt(
        120.0,
        "The longest one of Engram's own calls waits for that idle moment; then it runs "
        "anyway (a busy server still gets its summaries), and then it may evict the user's "
        "cached prompt on a one-slot server. 0: never wait.",
        min=0,
    )


@dataclass(frozen=True)
class MemorySettings:
    """[memory] — what is archived, and where."""

    enabled: bool = opt(True, "Archive conversations and inject memories. false: a pure proxy.")
    db_path: str = opt(
        "",
        "The SQLite file holding all memory. Empty: engram.db in the user data directory "
        "($XDG_DATA_HOME/engram, ~/Library/Application Support/engram, %APPDATA%\\engram).",
    )
    backend: str = opt(
        "sqlite",
        "Where memory lives. sqlite: one file (db_path), for one machine (several processes "
        "with server.workers). postgres: a PostgreSQL server with the vector extension "
        "(pgvector) at postgres_url, which several Engram replicas on several machines share.",
        choices=("sqlite", "postgres"),
    )
    postgres_url: str = opt(
        "",
        "The PostgreSQL database when backend is postgres: postgresql://USER:PASSWORD@HOST:PORT/"
        "DATABASE (postgres:// too; libpq's parameters as ?key=value, e.g. sslmode=require). "
        "Its password is masked wherever Engram shows the URL. The schema is created at first "
        "start (CREATE EXTENSION vector needs a role allowed to, once).",
    )
    redact_secrets: bool = opt(
        True,
        "Redact secrets (API keys and tokens of some 60 kinds, private keys, passwords in URLs, "
        "credential headers, random-looking values of password/secret/token/key names) in "
        "everything stored: turns, tool-result slots, summaries, facts, request records. "
        "Logs are redacted whatever this says.",
    )
    housekeeping_patterns: list[str] = opt(
        [],
        "Extra regular expressions; a request whose last user message matches one is "
        "treated as client housekeeping (titles, tags): answered, not archived, no memories.",
    )
    cache_mb: int = opt(
        384,
        "Memory (MiB) for the search indexes held in RAM per server: a third for users' "
        "full-text terms (BM25), two thirds for their vectors. 10,000 turns take about 6 + 16 "
        "MiB, 100,000 about 58 + 154; the users searched most recently are kept. A user who "
        "does not fit is searched in SQLite (FTS5, sqlite-vec) instead: slower, and BM25 then "
        "counts with FTS5's statistics of every user. 0: nothing held.",
        min=0,
    )
    admin_token: str = opt(
        "",
        "Token the admin API (/engram/api/*) requires as Authorization: Bearer. Empty: one is "
        "generated at first start into the file <db_path>.admin-token (mode 0600), which the "
        "engram command reads (`engram keys admin-token` prints it).",
    )
    job_lease: float = opt(
        30.0,
        "Seconds a background job's claim on its item (a session's summary, a sub-agent's "
        "hand-back, a request's consolidation) lasts unless renewed: with several processes "
        "on one database, how soon another takes over the job of one that died.",
        min=1,
    )


@dataclass(frozen=True)
class EmbedderSettings:
    """[embedder] — the embedding model."""

    model: str = opt(
        "engram/all-MiniLM-L6-v2-q8",
        "The default runs offline from PyPI packages: all-MiniLM-L6-v2 with int8 matrix "
        "products. A database whose vectors were made by the previous default "
        "(engram/all-MiniLM-L6-v2-int8, the same model in float32, twice as slow) keeps using "
        "it while this is the default, until `engram reindex`. Also: a "
        "folder with an ONNX model and tokenizer.json, any fastembed model name (needs its model "
        'hub once), or "hash" (a deterministic fake for tests; "hash-<dim>": of another size).',
    )
    cache_dir: str = opt("", "Where model folders are assembled. Empty: the user cache directory.")
    threads: int = opt(1, "ONNX threads (the model server next door wants the cores).", min=1)
    batch_size: int = opt(32, "Texts embedded per batch when archiving.", min=1, max=1024)
    on_unusable: str = opt(
        "refuse",
        "What `engram serve` does when the model cannot be used: it fails to load (a missing "
        "package or folder, the model hub unreachable), or the database's vectors were made by "
        "another model. refuse: stop at start-up, saying what to install or to run (`engram "
        "reindex` re-embeds every turn with this model); fts-only: serve with full-text search "
        "alone (no vector search, no new vectors), logging why.",
        choices=("refuse", "fts-only"),
    )


@dataclass(frozen=True)
class RetrievalSettings:
    """[retrieval] — hybrid search and what is injected."""

    top_k: int = opt(20, "Most memories injected into one request.", min=0, max=100)
    budget_tokens: int = opt(
        2000, "Most tokens the injected memory block may take (see also budget_share).", min=0
    )
    budget_share: float = opt(
        0.5,
        "The memory block takes at most this share of the prompt budget (context size "
        "minus the reply's room), so a small context keeps room for the conversation.",
        min=0,
        max=0.9,
    )
    candidates: int = opt(
        50,
        "Candidates taken from each path (FTS5 BM25, vector KNN) before fusion.",
        min=1,
        max=1000,
    )
    rrf_k: float = opt(
        10.0,
        "The k of Reciprocal Rank Fusion: 1/(k + rank). 10 rather than the customary 60: on "
        "LoCoMo (bench/locomo.py) no k=60 setting kept hybrid ahead of FTS5 alone in "
        "every question category, since a flat 1/(60 + rank) lets mid-list vector hits push out "
        "FTS5's top ones; k=10 did (R@5 0.67, R@10 0.75).",
        min=0,
    )
    fusion: str = opt(
        "scored",
        "How the two paths' candidates are merged: 'scored' ranks them by a weighted sum of "
        "what each path and each turn hold (the score_* weights; see proxy/search/scoring.py), "
        "'rrf' by Reciprocal Rank Fusion of their ranks alone (rrf_k, fts_weight, vec_weight). "
        "On LoCoMo's held-out half (bench/tune_fusion.py) scored fusion found 0.80 of the "
        "evidence in its top 10 against RRF's 0.74.",
        choices=("scored", "rrf"),
    )
    score_fts: float = opt(1.5, "Scored fusion: weight of BM25 relative to the best match.")
    score_vec: float = opt(
        0.5, "Scored fusion: weight of the cosine to the query (stretched over the vector list)."
    )
    score_speaker: float = opt(
        1.0, "Scored fusion: weight of a turn whose speaker the query names."
    )
    score_session: float = opt(
        0.8, "Scored fusion: weight of the best BM25 match in the turn's session."
    )
    score_neighbour: float = opt(
        0.6, "Scored fusion: weight of the best (stretched) cosine of the turns next to it."
    )
    score_length: float = opt(
        2.85, "Scored fusion: weight of the turn's length (log, counted up to 50 characters)."
    )
    score_time: float = opt(
        0.6,
        'Scored fusion: weight of a turn that says when ("last Friday", "in 2022") for a query '
        'about time ("When did...", "How long...", "...in May 2023?"); English only.',
    )
    score_when: float = opt(
        0.7,
        "Scored fusion: weight of \"the query names a time (a date, month, year; 'yesterday', "
        "'last week') and the turn was said then\". On LoCoMo, whose conversations span a few "
        "months (a third of the candidates fall in a named month), it adds little; it is for "
        "the relative times people ask a memory about.",
    )
    fts_weight: float = opt(1.0, "Weight of the FTS5 (BM25) path in the fusion.", min=0)
    vec_weight: float = opt(
        0.3,
        "Weight of the vector path in the fusion. Below FTS5's: on LoCoMo the vector path "
        "alone finds much less (R@10 0.44 against 0.75), and 0.3 gave the best top 5.",
        min=0,
    )
    neighbours: int = opt(
        0,
        "Turns on each side of a recalled turn, same session, added to the memory block "
        "after it when they fit and are not already in the prompt.",
        min=0,
        max=3,
    )
    question_neighbours: int = opt(
        3,
        "A question's best memories (this many, as the gate passed them) bring the turns just "
        "before and after them, same session, when those say something (content words, not a "
        "question alone, not a model's boilerplate, not a model's reply that only repeats the "
        "kept turns), share a word with their memory or the question, and are not already in "
        "the prompt: the answer often sits next to the "
        'turn that names the topic ("Congrats on the promotion!" follows the news). None when '
        "a memory holds every word the question asks about (its answer, as far as the store "
        "can tell), nor for a question about the user's own life or words ('my dentist "
        "appointment': beside the user's turns sit a model's replies). bench.replay (stable, "
        "4,096 tokens): questions with all their evidence in "
        "the prompt 0.678 -> 0.691 with 3 (0.713 with 5, before the last three rules), memory "
        "tokens a request 348 -> 371 (436). 0: none.",
        min=0,
        max=20,
    )
    mmr: bool = opt(False, "Re-rank with Maximal Marginal Relevance for diversity.")
    mmr_lambda: float = opt(
        0.5, "MMR trade-off: 1 is pure relevance, 0 pure diversity.", min=0, max=1
    )
    stop_words: bool = opt(True, "Drop English stop words from the FTS5 query.")
    recall_tool_outputs: bool = opt(
        False,
        "Recall stored tool outputs (role tool or function: web pages, files, command output) "
        "into later requests. Off: nobody in the conversation wrote that text, so it is where "
        "injected instructions most often hide. It stays archived (the admin API's search "
        "finds it), and a request that carries it itself still forwards it.",
    )
    fts_common_share: float = opt(
        0.3,
        "Once a user holds more than 500 turns, leave out of that user's FTS5 queries the "
        "words held by more than this share of the user's own turns (another user's archive "
        "never counts): they barely move BM25's ranking, yet FTS5 scores every row they match "
        "(at 100k turns 0.3 cut FTS5's time by a third; on LoCoMo, speaker names in every row, "
        "recall is the same or better without them, 0.15 costs 0.011 of R@10). 1 keeps every "
        "word.",
        min=0,
        max=1,
    )
    gate: bool = opt(
        True,
        "Inject a memory only where it bears on the message (proxy/search/relevance.py): top_k and "
        "the budgets are ceilings, a message that needs nothing (thanks, ok, an instruction "
        "about the task at hand) gets nothing. Off: the top_k best hits, whatever they are.",
    )
    gate_min_share: float = opt(
        0.8,
        "Gate: for a message that is not a question, a memory's fused score must be at least "
        "this share of the best hit's.",
        min=0,
        max=1,
    )
    gate_question_share: float = opt(
        0.75,
        "Gate: for a question, a memory's fused score must be at least this share of the best "
        "hit's, unless its cosine reaches gate_cosine_alone (bench.gate: 0.75 keeps 0.947 of "
        "the top 20's evidence on LoCoMo with 11.9 memories a question, against 0.960 with "
        "15.9 without it).",
        min=0,
        max=1,
    )
    gate_min_cosine: float = opt(
        0.5,
        "Gate: the cosine to a message that is not a question a full-text hit needs (a shared "
        "word alone is no relevance; bench.gate: 0.5 gives 1.1 % of messages that need no "
        "memory any, against 3.3 % with 0.35, LoCoMo's questions unchanged).",
        min=-1,
        max=1,
    )
    gate_question_cosine: float = opt(
        0.12,
        "Gate: the cosine to a question (a '?', or a question word first) a full-text hit "
        "needs (MiniLM's cosine of a question to a long turn that answers it is often under "
        "0.2; bench.gate: 0.12 keeps 0.961 of the top 20's evidence on LoCoMo against 0.944 "
        "with 0.2, 0.896 against 0.877 stored as a chat app's archive, where 3.2 % of the "
        "messages that need no memory get any against 2.9 %; bench.replay 0.652 -> 0.678).",
        min=-1,
        max=1,
    )
    gate_cosine_alone: float = opt(
        0.5,
        "Gate: the cosine a hit needs that full-text search did not find, or any hit of a "
        "message without content words.",
        min=-1,
        max=1,
    )
    gate_assistant_extra: float = opt(
        0.03,
        "Gate: the cosine a model's own reply needs beyond a user's words (what a model said "
        "is evidence of what was said, not of what is true).",
        min=0,
        max=1,
    )
    gate_statement_top: int = opt(
        1,
        "Gate: the most memories a message that is not a question gets (a question gets up to "
        "top_k; bench.prefix: with 3 the chats' statements drew loosely related turns).",
        min=0,
        max=100,
    )
    gate_best_cosine: float = opt(
        0.4,
        "Gate: the cosine to the message its closest hit needs before any memory goes: below "
        "it nothing stored is about the message (bench.gate: 0.960 of the top 20's evidence on "
        "LoCoMo passes against 0.962 without this bar, and 3.3 % of messages that need no "
        "memory get any against 10.6 %; 0.45 lost a plain 'Where does my sister live?').",
        min=-1,
        max=1,
    )
    gate_min_lift: float = opt(
        0.02,
        "Gate: how much closer to the message (cosine) a chat user's turn must be than an empty "
        "'user: ' turn, the start every such turn and the message are embedded with (on short "
        "texts it makes much of the cosine). 0.02: beyond the vectors' own noise; bench.gate, "
        "LoCoMo stored as a chat app's archive: 4.8 % of messages that need no memory get any "
        "against 7.8 % without it, 0.878 of the top 20's evidence kept against 0.893.",
        min=-1,
        max=1,
    )
    gate_lift_words: int = opt(
        20,
        "Gate: gate_min_lift reads only a turn with fewer content words than this: on a longer "
        "turn its words, not the shared 'user: ' start, make the cosine (\"Yeah, I'm really "
        'lucky to have them… since I moved from my home country…", full-text rank 1 for '
        '"Where did Caroline move from 4 years ago?", is 0.013 below the empty turn). '
        "bench.gate, LoCoMo stored as a chat app's archive: 0.896 of the top 20's evidence kept "
        "against 0.914 with 20, messages that need no memory given any 3.2 % against 3.3 %. "
        "0: the lift reads no turn.",
        min=0,
    )
    gate_min_words: int = opt(
        2,
        "Gate: content words (not stop words, greetings or thanks) a memory must hold: a bare "
        "acknowledgement is never one.",
        min=0,
        max=20,
    )

    def score_weights(self) -> dict[str, float]:
        """The scored fusion's weights by feature name (see proxy/search/scoring.py)."""
        return {
            "fts": self.score_fts,
            "vec": self.score_vec,
            "speaker": self.score_speaker,
            "session": self.score_session,
            "neighbour": self.score_neighbour,
            "length": self.score_length,
            "time": self.score_time,
            "when": self.score_when,
        }


@dataclass(frozen=True)
class PromptSettings:
    """[prompt] — how the forwarded prompt is assembled under the context budget."""

    mode: str = opt(
        "stable",
        "stable: each user message's memories lead that message and stay there in every later "
        "request (kept in the database), so each forwarded prompt extends the last byte for byte "
        "and the model server computes only what is new; a window cut, rare and deep, is the "
        "only time the prefix moves. zones: memories right after the system prompt (primacy), "
        "chosen afresh every turn: the model server recomputes the whole prompt each turn.",
        choices=("zones", "stable"),
    )
    whole_share: float = opt(
        0.8,
        "Mode zones: forward the whole conversation while it fits in this share of the "
        "budget; rewriting starts only when it pays. Mode stable goes whole while it fits at "
        "all (a cut moves the prefix).",
        min=0.05,
        max=1,
    )
    reply_reserve: int = opt(
        1024,
        "Tokens kept free for the reply when the request sets no max_tokens (at most "
        "reply_share of the context).",
        min=16,
    )
    reply_share: float = opt(
        0.25,
        "The most of the context kept free for the reply, whatever max_tokens asks: agents send "
        "their model's ceiling (opencode and Claude Code 32,000), which would leave a local "
        "model's context no room for the prompt.",
        min=0.01,
        max=0.9,
    )


@dataclass(frozen=True)
class SummarySettings:
    """[summary] — the rolling summary of a conversation's aged turns."""

    enabled: bool = opt(True, "Summarise turns that age out of the recent window (background).")
    max_tokens: int = opt(400, "Most tokens a summary may take.", min=32, max=4096)
    budget_share: float = opt(
        0.05, "Summariser tokens never exceed this share of the tokens proxied.", min=0, max=1
    )
    prompt_file: str = opt(
        "",
        "A file holding the summariser's instructions ({max_words} is filled in). Empty: the "
        "built-in ones, a copy of which is config/summary_prompt.txt.",
    )
    timeout: float = opt(300.0, "Seconds one summary request may take.", min=1)


@dataclass(frozen=True)
class SessionsSettings:
    """[sessions] — sub-agents (requests with X-Engram-Parent)."""

    max_depth: int = opt(
        2, "Deepest nesting of sub-agent sessions; deeper requests get a 400.", min=0, max=16
    )
    subagent_sees_parent_summary: bool = opt(
        False, "Let a sub-agent recall its parent's rolling summary (never its raw turns)."
    )
    complete_after_idle: float = opt(
        900.0,
        "Seconds without requests after which a sub-agent counts as completed and hands its "
        "summary back to its parent (0: only POST /engram/api/sessions/{id}/complete).",
        min=0,
    )


@dataclass(frozen=True)
class FeedbackSettings:
    """[feedback] — the record of recent chat requests that feedback can name."""

    keep_requests: int = opt(
        10_000,
        "Recent chat requests remembered per user (query, session, injected memory ids) so "
        "POST /engram/api/feedback can name one by its X-Engram-Request-Id.",
        min=1,
    )
    keep_days: float = opt(
        30.0,
        "Days a chat request stays in that record (flagged ones stay until consolidated).",
        min=0.01,
    )


@dataclass(frozen=True)
class ConsolidationSettings:
    """[consolidation] — flagged requests distilled into facts by the upstream, in the
    background."""

    budget_share: float = opt(
        0.05,
        "Consolidation tokens never exceed this share of the tokens proxied (its own budget, "
        "apart from the summariser's); over it, flagged requests wait.",
        min=0,
        max=1,
    )
    interval: float = opt(
        60.0,
        "Seconds between background passes over the queue (0: only POST "
        "/engram/api/consolidate runs it).",
        min=0,
    )
    batch: int = opt(10, "Flagged requests one pass takes at most.", min=1, max=1000)
    candidates: int = opt(
        200,
        "Candidates taken from each search path for a flagged request (the hot path takes "
        "retrieval.candidates).",
        min=1,
        max=1000,
    )
    top_k: int = opt(20, "Turns found per flagged request, before neighbours are added.", min=1)
    neighbours: int = opt(
        2, "Turns on each side of a found turn (same session) shown to the model too.", min=0
    )
    max_facts: int = opt(8, "Most facts kept from one flagged request.", min=1, max=100)
    max_tokens: int = opt(300, "Most tokens the model may answer with.", min=32, max=4096)
    max_attempts: int = opt(
        3, "Tries per flagged request (upstream failure, junk reply) before it is failed.", min=1
    )
    timeout: float = opt(300.0, "Seconds one consolidation request may take.", min=1)


@dataclass(frozen=True)
class SlotsSettings:
    """[slots] — bulky tool outputs forwarded as [TOOL_RESULT:id] references, kept in Redis or
    in the SQLite file, expanded on demand by a tool Engram adds and answers itself."""

    enabled: bool = opt(True, "Replace old, large tool outputs by references in forwarded prompts.")
    min_tokens: int = opt(
        500, "Tool outputs longer than this many tokens are replaced by a reference.", min=1
    )
    replace: str = opt(
        "when-full",
        "when-full: replace outputs only once the conversation no longer fits the budget (mode "
        "zones: past prompt.whole_share of it; then every old one at once, and from then "
        "on). Until then the model server's cache holds them: swapping one for a reference "
        "makes it recompute everything after it (measured on an agent loop through "
        "llama-server: 4.5x the tokens of that request). always: at every request, whatever "
        "the room (with the context size unknown, always).",
        choices=("when-full", "always"),
    )
    keep_recent: str = opt(
        "exchange",
        "Which tool outputs stay raw: 'exchange' (everything after the last user message), "
        "'round' (only those answering the latest tool calls; for long agent loops), 'none'.",
        choices=("exchange", "round", "none"),
    )
    detect_text_results: bool = opt(
        False,
        "Also replace tool results that text-protocol agents put in user messages (Cline's "
        "\"[read_file for 'x'] Result:\" blocks).",
    )
    ttl_seconds: int = opt(
        86400, "Seconds a slot lives after it was last stored or used (refreshed on use).", min=1
    )
    redis_url: str = opt(
        "",
        "Redis URL for the slots (e.g. redis://127.0.0.1:6379/0). Empty: the embedded store in "
        "the SQLite file. When Redis is down Engram uses the embedded store and retries Redis.",
        pattern=r"(?:(?:rediss?|unix)://\S+)?",
    )
    redis_key_prefix: str = opt("engram:slot", "Prefix of Engram's Redis keys.")
    redis_timeout: float = opt(
        0.5, "Seconds one Redis command may take before Redis counts as down.", min=0.01
    )
    redis_retry: float = opt(
        10.0, "Seconds between attempts to reach Redis again after it went away.", min=0.1
    )
    purge_interval: float = opt(
        300.0, "Seconds between purges of expired slots from the embedded store.", min=1
    )
    expand: bool = opt(
        True,
        "Add the expansion tool when the forwarded prompt holds references, and answer the "
        "model's calls to it (the client never sees them).",
    )
    expand_tool: str = opt(
        "engram_expand",
        "Name of the expansion tool Engram adds.",
        pattern=r"[A-Za-z_][A-Za-z0-9_-]{0,63}",
    )
    max_expansions: int = opt(
        3,
        "Round trips Engram makes for expansion calls in one request; after the last one the "
        "model is asked again without the tool.",
        min=1,
        max=20,
    )


@dataclass(frozen=True)
class LimitsSettings:
    """[limits] — caps that keep one big request or one heavy user from slowing everyone else.
    Each says what happens past it; the defaults suit one demanding user on a laptop, the
    figure in brackets a server shared by many."""

    max_messages: int = opt(
        2000,
        "Most messages a chat request may hold for memory to handle it. A longer one is "
        "forwarded exactly as sent (not archived, no memories, no rewrite: as with "
        "X-Engram-Memory: off), answered with X-Engram-Memories: 0; too-many-messages, and "
        "logged once per user per 10 minutes. 0: no cap. (Shared server: 1000.)",
        min=0,
    )
    max_message_bytes: int = opt(
        262_144,
        "Longest text of one message that is archived (UTF-8 bytes). A longer message is "
        "stored cut there, with a note saying how much was left out; full-text search and "
        "the embedding read what is stored. The request itself is forwarded whole. "
        "(Shared server: 65536.)",
        min=4096,
    )
    max_turns_per_user: int = opt(
        1_000_000,
        "Most turns one user's memory may hold. Past it new turns are not archived (the reply "
        "still goes, memories are still recalled), logged once per user per 10 minutes; "
        "forget old sessions or raise the cap. 0: no cap. (Shared server: 200000.)",
        min=0,
    )
    max_slot_bytes: int = opt(
        1_048_576,
        "Largest tool output kept in a tool-result slot (UTF-8 bytes); a larger one is "
        "forwarded raw, not slotted, and logged. (Shared server: 262144.)",
        min=1024,
    )
    max_slots_per_user: int = opt(
        10_000,
        "Most live tool-result slots one user may hold; past it new outputs are forwarded "
        "raw, not slotted, and logged. Counted by this server since it started (slots expire "
        "after slots.ttl_seconds). 0: no cap. (Shared server: 2000.)",
        min=0,
    )
    max_slot_bytes_per_user: int = opt(
        268_435_456,
        "Most bytes of live tool-result slots one user may hold; past it new outputs are "
        "forwarded raw, not slotted, and logged. 0: no cap. (Shared server: 33554432.)",
        min=0,
    )
    index_queue_turns: int = opt(
        4096,
        "Archived turns that may wait in memory for full-text indexing and their vector. "
        "Turns beyond it are deferred: stored and durable at once, indexed from the database "
        "once the queue has drained. The client's reply and recall never wait for indexing. "
        "(Shared server: 8192.)",
        min=1,
    )
    recall_deadline: float = opt(
        0.5,
        "Seconds recall may take before the request is forwarded without it: when the query's "
        "embedding is not ready by then the memories come from full-text search alone "
        "(X-Engram-Memories: N; fts-only), and when even that is not ready, none are injected "
        "(0; recall-timeout). A query embedding takes about 13 ms alone and 40 ms (p95) beside "
        "an archive batch on a busy 2-core machine; 0.5 s is reached only when the machine is "
        "stalled, where memories matter more than the wait. 0: no deadline. "
        "(Shared server: 0.15.)",
        min=0,
    )
    body_timeout: float = opt(
        60.0,
        "Seconds a request's body may take to arrive, counted from when Engram starts reading "
        "it (right after the headers). A body that stops short or trickles in slower gets a "
        "408 (body_timeout) and the connection is closed; one that breaks (a bad chunk, a "
        "connection cut mid-body) gets a 400 (unreadable_body) at once, also closed. 0: no "
        "limit. (Shared server: 30.)",
        min=0,
    )
    last_prompts_bytes: int = opt(
        33_554_432,
        "Bytes of recently forwarded prompts kept in memory, for the inspector's Requests "
        "pages (/engram/requests) and, apart, for each session's last request "
        "(/engram/api/sessions/{id}/requests/last): each keeps at most this, the oldest "
        "dropped first; nothing of it is written to disk. 0 keeps none. "
        "(Shared server: 67108864.)",
        min=0,
    )


@dataclass(frozen=True)
class InspectorSettings:
    """[inspector] — the web page at /engram/ that shows what Engram remembers, what it sent and
    why, and lets a person correct it."""

    enabled: bool = opt(
        True,
        "Serve the inspector at /engram/ (signing in takes the admin token or, with "
        "auth.mode = keys, a user's key). false: /engram/ answers 404.",
    )
    session_hours: float = opt(
        8.0,
        "Hours a sign-in lasts (the cookie's and the server's expiry); signing out ends it "
        "at once. Sign-ins live in the server's memory: a restart signs everyone out.",
        min=0.01,
        max=720,
    )


@dataclass(frozen=True)
class Settings:
    """All of Engram's settings."""

    server: ServerSettings = field(default_factory=ServerSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    embedder: EmbedderSettings = field(default_factory=EmbedderSettings)
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)
    prompt: PromptSettings = field(default_factory=PromptSettings)
    summary: SummarySettings = field(default_factory=SummarySettings)
    sessions: SessionsSettings = field(default_factory=SessionsSettings)
    feedback: FeedbackSettings = field(default_factory=FeedbackSettings)
    consolidation: ConsolidationSettings = field(default_factory=ConsolidationSettings)
    slots: SlotsSettings = field(default_factory=SlotsSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    inspector: InspectorSettings = field(default_factory=InspectorSettings)

    def __post_init__(self) -> None:
        problem = _cross_check(self)
        if problem:
            raise ConfigError(problem)


def _cross_check(settings: Settings) -> str | None:
    """A combination of settings that is refused although each value is valid alone."""
    open_to_all = [o for o in settings.server.cors_origins if o.strip().lower() in ("*", "null")]
    if open_to_all and settings.memory.enabled:
        why = " (any site sends it from a sandboxed frame)" if open_to_all[0] != "*" else ""
        return (
            f"config: server.cors_origins contains {open_to_all[0]!r}{why} while "
            "memory.enabled is true: every web page you visit could then write into your "
            "memory and read your model's answers. List your web apps' origins instead "
            '(e.g. ["http://localhost:3000"]), or set memory.enabled = false for a pure proxy.'
        )
    memory = settings.memory
    if memory.backend == "postgres" and not memory.postgres_url.startswith(
        ("postgresql://", "postgres://")
    ):
        return (
            "config: memory.backend is postgres but memory.postgres_url is "
            + ("empty" if not memory.postgres_url else "not a postgresql:// or postgres:// URL")
            + ": set it to postgresql://USER:PASSWORD@HOST:PORT/DATABASE "
            "(or ENGRAM_MEMORY_POSTGRES_URL)"
        )
    return None


# --- introspection -----------------------------------------------------------------------------


def sections() -> dict[str, type[Any]]:
    """Section name -> its dataclass, in declaration order."""
    hints = typing.get_type_hints(Settings)
    return {f.name: hints[f.name] for f in dataclasses.fields(Settings)}


def _fields(section_cls: type[Any]) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def _describe(tp: Any, meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    if meta.get("pattern"):
        each = "a list of strings, each" if typing.get_origin(tp) is list else "a string"
        return f"{each} matching {meta['pattern']}"
    lo, hi = meta.get("min"), meta.get("max")
    name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, "a list of strings"
    )
    if lo is not None and hi is not None:
        return f"{name} from {lo:g} to {hi:g}"
    if lo is not None:
        return f"{name} >= {lo:g}"
    return name


def _coerce(
    key: str, source: str, raw: Any, tp: Any, meta: Mapping[str, Any], from_text: bool
) -> Any:
    """Turn ``raw`` into a value of ``tp`` or raise a ConfigError naming the key."""

    def bad() -> ConfigError:
        return ConfigError(
            f"config: {key} = {raw!r} (from {source}) is not valid; expected {_describe(tp, meta)}"
        )

    value: Any
    if tp is bool:
        if isinstance(raw, bool):
            value = raw
        elif from_text and isinstance(raw, str) and raw.strip().lower() in _BOOLS:
            value = _BOOLS[raw.strip().lower()]
        else:
            raise bad()
    elif tp is int:
        if isinstance(raw, bool):
            raise bad()
        if isinstance(raw, int):
            value = raw
        elif from_text and isinstance(raw, str):
            try:
                value = int(raw.strip().replace("_", ""))
            except ValueError:
                raise bad() from None
        else:
            raise bad()
    elif tp is float:
        if isinstance(raw, bool):
            raise bad()
        if isinstance(raw, int | float):
            value = float(raw)
        elif from_text and isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                raise bad() from None
        else:
            raise bad()
    elif tp is str:
        if not isinstance(raw, str):
            raise bad()
        value = raw
    elif typing.get_origin(tp) is list:
        if from_text and isinstance(raw, str):
            text = raw.strip()
            if text.startswith("["):
                try:
                    raw = json.loads(text)
                except ValueError:
                    raise bad() from None
            else:
                raw = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise bad()
        value = list(raw)
    else:  # pragma: no cover - a declaration error, caught by the tests
        raise TypeError(f"unsupported setting type for {key}: {tp!r}")

    choices = meta.get("choices")
    if choices and value not in choices:
        raise bad()
    pattern = meta.get("pattern")
    if pattern and not all(re.fullmatch(pattern, v) for v in _strings(value)):
        raise bad()
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad()
    return value


def _strings(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


_BOOLS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


# --- layering ----------------------------------------------------------------------------------

Layer = Mapping[str, Mapping[str, Any]]


def _apply(values: dict[str, dict[str, Any]], layer: Layer, source: str, from_text: bool) -> None:
    secs = sections()
    for sec_name, items in layer.items():
        if sec_name not in secs:
            raise ConfigError(
                f"config: unknown section [{sec_name}] (from {source}); known sections: "
                + ", ".join(secs)
            )
        if not isinstance(items, Mapping):
            raise ConfigError(f"config: [{sec_name}] (from {source}) must be a table of keys")
        flds = _fields(secs[sec_name])
        for key, raw in items.items():
            if key not in flds:
                raise ConfigError(
                    f"config: unknown key {sec_name}.{key} (from {source}); known keys in "
                    f"[{sec_name}]: " + ", ".join(flds)
                )
            fld, tp = flds[key]
            values[sec_name][key] = _coerce(
                f"{sec_name}.{key}", source, raw, tp, fld.metadata, from_text
            )


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML settings file, turning syntax errors into ConfigError."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config: file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from None


def env_layer(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Collect ``ENGRAM_<SECTION>_<KEY>`` variables; unknown ones are an error."""
    secs = sections()
    layer: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _ENV_NOT_SETTINGS:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        sec, _, key = rest.partition("_")
        if sec not in secs or key not in _fields(secs[sec]):
            raise ConfigError(
                f"config: unknown environment variable {name}; settings variables are "
                f"ENGRAM_<SECTION>_<KEY>, e.g. ENGRAM_SERVER_PORT (sections: {', '.join(secs)})"
            )
        layer.setdefault(sec, {})[key] = value
    return layer


def load_settings(
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Layer | None = None,
) -> Settings:
    """Build validated settings from defaults < file < environment < overrides (flags)."""
    secs = sections()
    values: dict[str, dict[str, Any]] = {name: {} for name in secs}
    if config_file is not None:
        _apply(values, read_toml(config_file), str(config_file), from_text=False)
    if environ is not None:
        for sec, items in env_layer(environ).items():
            for key, raw in items.items():
                _apply(
                    values,
                    {sec: {key: raw}},
                    f"{ENV_PREFIX}{sec.upper()}_{key.upper()}",
                    from_text=True,
                )
    if overrides:
        _apply(values, overrides, "command line", from_text=False)
    built = {name: cls(**values[name]) for name, cls in secs.items()}
    return Settings(**built)


def replace(settings: Settings, section: str, **changes: Any) -> Settings:
    """A copy of ``settings`` with some keys of one section changed (validated)."""
    layer = {section: changes}
    values: dict[str, dict[str, Any]] = {
        name: dataclasses.asdict(getattr(settings, name)) for name in sections()
    }
    _apply(values, layer, "code", from_text=False)
    return Settings(**{name: cls(**values[name]) for name, cls in sections().items()})


# --- rendering config/engram.toml --------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(type(value))


def render_defaults() -> str:
    """The text of ``config/engram.toml``: every setting with its default and a comment."""
    lines = [
        "# Engram's settings, every one at its default. Generated from proxy/config.py by",
        "# `make config`; a test checks that this file and the code agree.",
        "#",
        "# Override in a file passed with --config, with ENGRAM_<SECTION>_<KEY> environment",
        "# variables (e.g. ENGRAM_SERVER_PORT=9000), or with command-line flags, in that order.",
    ]
    for sec_name, cls in sections().items():
        lines += ["", f"[{sec_name}]"]
        for key, (fld, tp) in _fields(cls).items():
            default = (
                fld.default_factory()
                if fld.default_factory is not dataclasses.MISSING
                else fld.default
            )
            lines.append(f"# {fld.metadata['help']} ({_describe(tp, fld.metadata)})")
            lines.append(f"{key} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


def render_markdown() -> str:
    """The text of ``docs/configuration.md``: every setting, its default and what it does, a
    table per section (``make docs``; a test checks the page and the code agree)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from proxy/config.py by `make docs`; a test checks that this page and",
        "the code agree. Edit the settings' help there, not here. -->",
        "",
        "Every setting has a default; `config/engram.toml` lists them all as a file to copy.",
        "Override them in a file passed with `--config`, with `ENGRAM_<SECTION>_<KEY>` environment",
        "variables (e.g. `ENGRAM_SERVER_PORT=9000`), or with command-line flags, in that order.",
        "An unknown key, a value of the wrong type or out of its range stops Engram at start with",
        "a message naming the key. `engram config` prints the settings in effect.",
    ]
    for sec_name, cls in sections().items():
        doc = " ".join((cls.__doc__ or "").split()).removeprefix(f"[{sec_name}] — ")
        doc = doc[:1].upper() + doc[1:]
        lines += ["", f"## [{sec_name}]", "", doc, "", "| key | default | takes | what it does |"]
        lines.append("|---|---|---|---|")
        for key, (fld, tp) in _fields(cls).items():
            default = (
                fld.default_factory()
                if fld.default_factory is not dataclasses.MISSING
                else fld.default
            )
            cells = [
                f"`{key}`",
                f"`{_toml_value(default)}`",
                _describe(tp, fld.metadata),
                str(fld.metadata["help"]),
            ]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def as_dict(settings: Settings) -> dict[str, Any]:
    """Settings as plain data (for `engram config` and diagnostics)."""
    return dataclasses.asdict(settings)
