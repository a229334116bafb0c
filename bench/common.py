"""Shared by the benchmarks: machine figures, an on-disk embedding cache, LoCoMo.

Imported by the other ``bench`` modules (and by ``tests/store/test_recall_quality.py``), each
run from the repository root as ``python -m bench.<name>``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from proxy.search.embedder import Embedder, Kind
from proxy.store import NewTurn, Store, queries
from proxy.store.models import EMBED_CHARS, index_text, text_hash
from proxy.store.sqlite.db import database_info
from proxy.vectors import Vector

ROOT = Path(__file__).resolve().parent.parent


def _locomo_path() -> Path:
    """LoCoMo's data, read in place: ``$ENGRAM_LOCOMO``, else the shared folder beside this
    checkout, else the workplace's shared folder (a clone elsewhere, as CI makes)."""
    if os.environ.get("ENGRAM_LOCOMO"):
        return Path(os.environ["ENGRAM_LOCOMO"])
    tail = Path("shared") / "bench" / "locomo" / "locomo10.json"
    beside = ROOT.parent / tail
    for candidate in (beside, Path("/work") / tail):
        if candidate.is_file():
            return candidate
    return beside


DEFAULT_LOCOMO = _locomo_path()
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "engram-bench"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


# ---- machine -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """CPU, cores, Python, library versions and the date, for the top of a report."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    db = database_info()
    versions = {}
    for dist in ("fastembed", "onnxruntime", "numpy", "sqlean.py", "aiohttp"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sqlite": f"{db.sqlite_version} ({db.driver})",
        "sqlite_vec": db.vec_version,
        "versions": versions,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def machine_lines(m: dict[str, Any]) -> list[str]:
    libs = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return [
        f"CPU: {m['cpu']} ({m['cores']} cores), {m['platform']}",
        f"Python {m['python']}, SQLite {m['sqlite']}, sqlite-vec {m['sqlite_vec']}, {libs}",
        f"Date: {m['date']}; load average {' / '.join(str(x) for x in m['load'])} "
        "(1/5/15 min) at the start",
    ]


def pct(values: Sequence[float], p: int) -> float:
    """The p-th percentile of seconds, in milliseconds."""
    if len(values) < 2:
        return float(values[0]) * 1000.0 if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] * 1000.0


# ---- embedding cache ---------------------------------------------------------------------


class DiskCachedEmbedder:
    """Wraps an :class:`~proxy.search.embedder.Embedder`; vectors persist in ``folder`` across runs.

    Keyed by (model name, kind, text). :meth:`save` writes new vectors (``aclose`` does too).
    Benchmarks only: the vectors are the inner model's, bit for bit.
    """

    def __init__(self, inner: Embedder, folder: Path) -> None:
        self.inner = inner
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", inner.name)
        self._keys_file = folder / f"{safe}.keys.json"
        self._vecs_file = folder / f"{safe}.npy"
        self._index: dict[str, int] = {}
        self._rows: list[Vector] = []
        self._saved = 0
        self.hits = self.misses = 0
        if self._keys_file.is_file() and self._vecs_file.is_file():
            keys = json.loads(self._keys_file.read_text())
            matrix = np.load(self._vecs_file)
            if len(keys) == len(matrix):
                self._index = {k: i for i, k in enumerate(keys)}
                self._rows = list(matrix.astype(np.float32))
                self._saved = len(keys)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dim(self) -> int:
        return self.inner.dim

    async def load(self) -> None:
        await self.inner.load()

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("query", texts)

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("passage", texts)

    async def aclose(self) -> None:
        self.save()
        await self.inner.aclose()

    def has(self, kind: Kind, texts: Sequence[str]) -> bool:
        return all(self._key(kind, t) in self._index for t in texts)

    def _key(self, kind: Kind, text: str) -> str:
        return hashlib.blake2b(f"{self.name}\0{kind}\0{text}".encode(), digest_size=16).hexdigest()

    async def _embed(self, kind: Kind, texts: Sequence[str]) -> list[Vector]:
        keys = [self._key(kind, t) for t in texts]
        todo = {k: t for k, t in zip(keys, texts, strict=True) if k not in self._index}
        self.hits += len(keys) - len(todo)
        self.misses += len(todo)
        if todo:
            run = self.inner.embed_queries if kind == "query" else self.inner.embed_passages
            for key, vec in zip(todo, await run(list(todo.values())), strict=True):
                self._index[key] = len(self._rows)
                self._rows.append(np.asarray(vec, dtype=np.float32))
        return [self._rows[self._index[k]] for k in keys]

    def save(self) -> None:
        if len(self._rows) == self._saved:
            return
        self._keys_file.parent.mkdir(parents=True, exist_ok=True)
        keys = sorted(self._index, key=self._index.__getitem__)
        tmp_vecs = self._vecs_file.with_suffix(".tmp.npy")
        np.save(tmp_vecs, np.stack(self._rows).astype(np.float32))
        tmp_keys = self._keys_file.with_suffix(".tmp")
        tmp_keys.write_text(json.dumps(keys))
        tmp_vecs.replace(self._vecs_file)
        tmp_keys.replace(self._keys_file)
        self._saved = len(self._rows)


# ---- LoCoMo ------------------------------------------------------------------------------


@dataclass
class LocomoTurn:
    dia_id: str
    speaker: str
    role: str
    content: str  # text, plus " [image: caption]" when an image was shared
    session: int
    timestamp: float | None


@dataclass
class LocomoConversation:
    sample_id: str
    turns: list[LocomoTurn]


@dataclass
class LocomoQuestion:
    conversation: int  # index into the conversations
    question: str
    category: int
    evidence: set[str]


@dataclass
class EvidenceLog:
    """How the cited evidence ids were cleaned up."""

    repaired: Counter[str] = field(default_factory=Counter)  # "raw -> fixed"
    dropped: Counter[str] = field(default_factory=Counter)  # ids that name no turn
    questions_without_evidence: int = 0
    questions_skipped_category: int = 0


def parse_locomo_date(text: str) -> float | None:
    """``"1:56 pm on 8 May, 2023"`` as Unix seconds (read as UTC); None if unreadable."""
    try:
        when = dt.datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y")
    except ValueError:
        return None
    return when.replace(tzinfo=dt.UTC).timestamp()


def repair_evidence(raw: Sequence[str], valid: set[str], log: EvidenceLog) -> set[str]:
    """Cited dia_ids, repaired where the intent is clear ("D8:6; D9:17", "D:11:26", "D30:05")."""
    out: set[str] = set()
    for item in raw:
        fixed_ids = []
        for part in (p for p in re.split(r"[;,\s]+", item.strip()) if p):
            fixed = re.sub(r"^D:(\d+):", r"D\1:", part)
            m = re.match(r"^D(\d+):0*(\d+)$", fixed)
            if m:
                fixed = f"D{m.group(1)}:{m.group(2)}"
            if fixed in valid:
                fixed_ids.append(fixed)
            else:
                log.dropped[part] += 1
        if fixed_ids != [item] and fixed_ids:
            log.repaired[f"{item!r} -> {' '.join(fixed_ids)}"] += 1
        out.update(fixed_ids)
    return out


def load_locomo(
    path: Path, limit: int | None = None, categories: Sequence[int] = (1, 2, 3, 4)
) -> tuple[list[LocomoConversation], list[LocomoQuestion], EvidenceLog]:
    data = json.loads(path.read_text())
    if limit is not None:
        data = data[:limit]
    convs: list[LocomoConversation] = []
    questions: list[LocomoQuestion] = []
    log = EvidenceLog()
    for ci, sample in enumerate(data):
        conv = sample["conversation"]
        roles = {conv["speaker_a"]: "user", conv["speaker_b"]: "assistant"}
        numbers = sorted(int(k.split("_")[1]) for k in conv if re.fullmatch(r"session_\d+", k))
        turns: list[LocomoTurn] = []
        for n in numbers:
            when = parse_locomo_date(conv.get(f"session_{n}_date_time", ""))
            for t in conv[f"session_{n}"]:
                caption = t.get("blip_caption")
                content = t["text"] + (f" [image: {caption}]" if caption else "")
                turns.append(
                    LocomoTurn(
                        t["dia_id"], t["speaker"], roles.get(t["speaker"], "user"), content, n, when
                    )
                )
        convs.append(LocomoConversation(sample["sample_id"], turns))
        valid = {t.dia_id for t in turns}
        for q in sample["qa"]:
            if q["category"] not in categories:
                log.questions_skipped_category += 1
                continue
            evidence = repair_evidence(q.get("evidence", []), valid, log)
            if not evidence:
                log.questions_without_evidence += 1
                continue
            questions.append(LocomoQuestion(ci, q["question"], q["category"], evidence))
    return convs, questions, log


def locomo_records(conv: LocomoConversation) -> list[dict[str, Any]]:
    """One conversation as import records: one user namespace, one Engram session per session."""
    return [
        {
            "user": conv.sample_id,
            "session": f"{conv.sample_id}-s{t.session}",
            "role": t.role,
            "speaker": t.speaker,
            "content": t.content,
            "timestamp": t.timestamp,
        }
        for t in conv.turns
    ]


# ---- loading through the project's code --------------------------------------------------


async def import_turns(
    store: Store,
    embedder: Embedder | None,
    records: Sequence[dict[str, Any]],
    batch: int = 256,
    via: str = "auto",
) -> str:
    """Store ``records`` (dicts: user, session, role, speaker, content, timestamp) the way
    ``engram import`` does: :func:`proxy.cli.importer.import_records` where that module exists,
    else ``Store.add_turns`` with vectors of :func:`~proxy.store.models.index_text` (as the chat
    pipeline archives). ``via``: "auto", "importer" or "store". Returns the path used."""
    try:
        if via == "store":
            raise ImportError
        from proxy.cli.importer import import_records
    except ImportError:
        if via == "importer":
            raise
        await _add_turns_directly(store, embedder, records, batch)
        return "Store.add_turns"
    report = await import_records(store, embedder, enumerate(records, 1), batch)
    if report.errors:
        raise RuntimeError(f"import rejected {len(report.errors)} records: {report.errors[:3]}")
    return "proxy.cli.importer.import_records"


async def _add_turns_directly(
    store: Store, embedder: Embedder | None, records: Sequence[dict[str, Any]], batch: int
) -> None:
    positions: dict[str, int] = {}
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        texts = [index_text(r["role"], r.get("speaker"), r["content"])[:EMBED_CHARS] for r in chunk]
        vectors = await embedder.embed_passages(texts) if embedder is not None else None
        by_session: dict[tuple[str, str], list[int]] = {}
        for i, r in enumerate(chunk):
            by_session.setdefault((r["user"], r["session"]), []).append(i)
        for (user, sid), idx in by_session.items():
            if sid not in positions:
                await store.get_or_create_session(user, sid)
                positions[sid] = await store.count_turns(sid)
            turns = []
            for i in idx:
                r = chunk[i]
                turns.append(
                    NewTurn(
                        positions[sid],
                        r["role"],
                        r["content"],
                        speaker=r.get("speaker"),
                        timestamp=r.get("timestamp"),
                        embed_hash=text_hash(texts[i]),
                    )
                )
                positions[sid] += 1
            await store.add_turns(
                sid, user, turns, [vectors[i] for i in idx] if vectors is not None else None
            )


async def embedded_text_check(store: Store, user: str) -> str | None:
    """None when the stored vectors were computed from ``index_text`` (what chat archiving
    embeds), else a warning naming what they were computed from."""
    turns = await store.read(lambda c: queries.user_turns_page(c, user, 0, 20))
    hashes = dict(
        await store.read(
            lambda c: c.execute(
                "SELECT id, embed_hash FROM turns WHERE user_id = ? ORDER BY id LIMIT 20", (user,)
            ).fetchall()
        )
    )
    for t in turns:
        wanted = text_hash(index_text(t.role, t.speaker, t.content)[:EMBED_CHARS])
        got = hashes.get(t.id)
        if got is not None and got != wanted:
            plain = text_hash(t.content[:EMBED_CHARS])
            what = "the bare content" if got == plain else "some other text"
            return (
                f"warning: the import path embedded {what}, not index_text(role, speaker, "
                "content) as chat archiving does; vector figures are not the chat pipeline's"
            )
    return None


# ---- a synthetic archive from LoCoMo text ------------------------------------------------


def synthetic_records(
    convs: Sequence[LocomoConversation], n: int, user: str, session_turns: int = 20
) -> list[dict[str, Any]]:
    """``n`` import records for ``user``, cycling LoCoMo's turns: the first cycle as written,
    later cycles each turn followed by the first dozen words of another turn (so every text is
    distinct, about 40 words), sessions of ``session_turns`` turns, a day later per cycle."""
    base = [t for conv in convs for t in conv.turns]
    out: list[dict[str, Any]] = []
    for i in range(n):
        cycle, j = divmod(i, len(base))
        t = base[j]
        content = t.content
        if cycle:
            other = base[(j * 31 + cycle * 977) % len(base)]
            content += " " + " ".join(other.content.split()[:12])
        out.append(
            {
                "user": user,
                "session": f"{user}-s{i // session_turns}",
                "role": t.role,
                "speaker": t.speaker,
                "content": content,
                "timestamp": (t.timestamp or 1.6e9) + cycle * 86400.0,
            }
        )
    return out


def embed_texts(records: Sequence[dict[str, Any]]) -> list[str]:
    """The texts the import path embeds for ``records`` (``index_text``, cut to EMBED_CHARS)."""
    return [index_text(r["role"], r.get("speaker"), r["content"])[:EMBED_CHARS] for r in records]
