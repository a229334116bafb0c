"""Calibrating the relevance gate (:mod:`proxy.search.relevance`) on LoCoMo and on messages that
need no memory.

    .venv/bin/python -m bench.gate [--limit-conversations N] [--data features.json]
        [--collect-only] [--json out.json]

Each LoCoMo conversation is imported as one user (as :mod:`bench.locomo` does) and every
question of categories 1-4 is searched as Engram recalls (``Retriever.search``, top 20, the
default scored fusion); so is every message of :data:`bench.gate_data.NO_MEMORY` (greetings,
thanks, instructions about the task at hand, general questions) against every conversation, and
again against every conversation stored as a chat app's archive is: the first speaker's turns
as the user's, no name (``"user: …"``, the text the query's vector is made from too: on short
texts that shared start alone lifts the cosine, "Okay, let's keep going." and "…so let's keep it
simple." 0.38 bare, 0.62 so), the second speaker's under their name (a person, not a model);
LoCoMo's questions are asked there too.
For each hit the features the gate reads are kept: its rank, fused score and share of the best
score, its cosine to the query, its rank on each path, its role, its words; and whether it is one
of the question's evidence turns. ``--data`` keeps them in a file (``--collect-only`` stops
there), so the gate's settings can be tried again without searching.

Then the gate of the configured settings, and a grid around them, is applied to every list, and
for each setting this prints: evidence kept (evidence turns the gate passes over those the top 20
held: the recall the gate costs), questions with all / any evidence kept (of those whose top 20
held it), memories per question, and for the no-memory messages the share that get any memory
and the memories each gets. The data is CC BY-NC: it is read in place, never copied.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    DEFAULT_CACHE,
    DEFAULT_LOCOMO,
    DiskCachedEmbedder,
    import_turns,
    load_locomo,
    locomo_records,
    machine,
    machine_lines,
)
from bench.gate_data import NO_MEMORY
from bench.locomo import load, stored_dia
from proxy.config import RetrievalSettings
from proxy.search.embedder import DEFAULT_MODEL, create_embedder
from proxy.search.relevance import GateSettings, HitFeatures, admit, query_content
from proxy.search.retrieval import Retriever, vector_text
from proxy.store import Store

TOP = 20


async def searched(retriever: Retriever, user: str, query: str) -> list[dict[str, Any]]:
    """The top 20 for ``query`` as the gate reads them, baselines included."""
    hits = await retriever.search(user, query, TOP)
    assert retriever.embedder is not None
    qvec = (await retriever.embedder.embed_queries([vector_text(query)]))[0]
    base = await retriever.baselines(hits, qvec)
    return [{**features(h, 0), "baseline": b} for h, b in zip(hits, base, strict=True)]


async def ask(
    retriever: Retriever,
    convs: list[Any],
    questions: list[Any],
    dia: dict[str, dict[int, str]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every question's and every no-memory message's top 20 (for each conversation), as the
    gate reads them; a question's hits say whether they are its evidence."""
    asked: list[dict[str, Any]] = []
    for q in questions:
        user = convs[q.conversation].sample_id
        hits = await searched(retriever, user, q.question)
        asked.append(
            {
                "query": q.question,
                "category": q.category,
                "hits": [{**h, "evidence": dia[user][h["id"]] in q.evidence} for h in hits],
                "evidence": len(q.evidence),
            }
        )
    negatives: list[dict[str, Any]] = []
    for conv in convs:
        for text in NO_MEMORY:
            hits = await searched(retriever, conv.sample_id, text)
            negatives.append({"query": text, "hits": hits})
    return asked, negatives


def features(hit: Any, query_words: int) -> dict[str, Any]:
    t = hit.turn
    return {
        "id": t.id,
        "score": hit.score,
        "cosine": hit.cosine,
        "fts": hit.ranks.get("fts"),
        "vec": hit.ranks.get("vec"),
        "role": t.role,
        "content": t.content,
    }


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    convs, questions, _ = load_locomo(args.locomo, args.limit_conversations)
    inner = create_embedder(DEFAULT_MODEL, threads=2)
    embedder = DiskCachedEmbedder(inner, args.cache_dir)
    out: dict[str, Any] = {
        "questions": [],
        "negatives": [],
        "questions_chat": [],
        "negatives_chat": [],
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            async with Store(Path(tmp) / "gate.db") as store:
                dia, _, _, _ = await load(store, embedder, convs, "auto")
                retriever = Retriever(store, embedder, RetrievalSettings())
                out["questions"], out["negatives"] = await ask(retriever, convs, questions, dia)
            async with Store(Path(tmp) / "chat.db") as store:
                # The first speaker as a chat app's user (no name); the second keeps the name:
                # a person, not a model (bench.replay stores both by role, so there the second
                # speaker's turns read as a model's replies).
                records = [
                    {**r, "speaker": None if r["role"] == "user" else r["speaker"]}
                    for conv in convs
                    for r in locomo_records(conv)
                ]
                await import_turns(store, embedder, records)
                chat = await stored_dia(store, convs)
                retriever = Retriever(store, embedder, RetrievalSettings())
                # the same questions (they name people the turns do not)
                asked = await ask(retriever, convs, questions, chat)
                out["questions_chat"], out["negatives_chat"] = asked
    finally:
        await embedder.aclose()
    return out


def gated(item: dict[str, Any], g: GateSettings) -> list[dict[str, Any]]:
    hits = [
        HitFeatures(
            h["score"], h["cosine"], h["fts"], h["vec"], h["role"], h["content"], h.get("baseline")
        )
        for h in item["hits"]
    ]
    keep = admit(query_content(item["query"]), hits, g)
    return [item["hits"][i] for i in keep]


def evaluate(data: dict[str, Any], g: GateSettings) -> dict[str, float]:
    kept_ev = total_ev = 0
    all_kept = any_kept = all_had = any_had = 0
    per_q: list[int] = []
    for q in data["questions"]:
        had = [h for h in q["hits"] if h["evidence"]]
        kept = gated(q, g)
        ke = [h for h in kept if h["evidence"]]
        total_ev += len(had)
        kept_ev += len(ke)
        per_q.append(len(kept))
        if had:
            any_had += 1
            any_kept += bool(ke)
        if len(had) == q["evidence"]:
            all_had += 1
            all_kept += len(ke) == q["evidence"]
    chat_kept = chat_total = 0
    for q in data.get("questions_chat", []):
        chat_total += sum(1 for h in q["hits"] if h["evidence"])
        chat_kept += sum(1 for h in gated(q, g) if h["evidence"])
    neg = [len(gated(n, g)) for n in data["negatives"]]
    chat = [len(gated(n, g)) for n in data.get("negatives_chat", [])]
    return {
        "evidence_kept": kept_ev / max(1, total_ev),
        "all_kept": all_kept / max(1, all_had),
        "any_kept": any_kept / max(1, any_had),
        "per_question": statistics.mean(per_q) if per_q else 0.0,
        "negatives_with_any": sum(1 for n in neg if n) / max(1, len(neg)),
        "per_negative": statistics.mean(neg) if neg else 0.0,
        "chat_evidence_kept": chat_kept / max(1, chat_total),
        "chat_negatives_with_any": sum(1 for n in chat if n) / max(1, len(chat)),
        "per_chat_negative": statistics.mean(chat) if chat else 0.0,
    }


def grid(base: GateSettings) -> list[GateSettings]:
    out = [base, dataclasses.replace(base, enabled=False)]
    for lift in (-2.0, 0.0, 0.02, 0.05, 0.08, 0.1, 0.15):
        out.append(dataclasses.replace(base, min_lift=lift))
    for words in (8, 12, 15, 30, 1_000_000):
        out.append(dataclasses.replace(base, lift_words=words))
    for question in (0.08, 0.12, 0.16, 0.2, 0.25, 0.3):
        for extra in (0.0, 0.03, 0.05):
            out.append(dataclasses.replace(base, question_cosine=question, assistant_extra=extra))
    for rel in (0.7, 0.8, 0.85):
        for floor in (0.3, 0.35, 0.4):
            out.append(dataclasses.replace(base, min_share=rel, min_cosine=floor))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    p.add_argument("--limit-conversations", type=int, default=None)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--data", type=Path, default=None, help="features file (read if present)")
    p.add_argument("--collect-only", action="store_true")
    p.add_argument("--grid", action="store_true", help="also a grid around the defaults")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.data is not None and args.data.exists():
        data = json.loads(args.data.read_text())
    else:
        data = asyncio.run(collect(args))
        if args.data is not None:
            args.data.write_text(json.dumps(data))
    if args.collect_only:
        return 0
    base = GateSettings.of(RetrievalSettings())
    rows = []
    for g in grid(base) if args.grid else [base, dataclasses.replace(base, enabled=False)]:
        r = evaluate(data, g)
        rows.append((g, r))
    print("\n".join(machine_lines(machine())))
    print(
        f"LoCoMo questions: {len(data['questions'])}; no-memory messages:"
        f" {len(data['negatives'])} ({len(NO_MEMORY)} x conversations)\n"
    )
    print(
        "| gate | min share | min cosine | question cosine | cosine alone | assistant + |"
        " min lift | lift words | evidence kept |"
        " all kept | any kept | memories / question | no-memory msgs given any |"
        " memories / no-memory msg | chat archives: evidence kept | no-memory msgs given any |"
        " memories / no-memory msg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g, r in sorted(rows, key=lambda x: -x[1]["evidence_kept"]):
        print(
            f"| {'on' if g.enabled else 'off'} | {g.min_share:.2f} | {g.min_cosine:.2f} |"
            f" {g.question_cosine:.2f} | {g.cosine_alone:.2f} | {g.assistant_extra:.2f} |"
            f" {g.min_lift:.2f} | {g.lift_words} |"
            f" {r['evidence_kept']:.3f} |"
            f" {r['all_kept']:.3f} | {r['any_kept']:.3f} | {r['per_question']:.1f} |"
            f" {r['negatives_with_any']:.3f} | {r['per_negative']:.2f} |"
            f" {r['chat_evidence_kept']:.3f} | {r['chat_negatives_with_any']:.3f} |"
            f" {r['per_chat_negative']:.2f} |"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps([{"gate": dataclasses.asdict(g), **r} for g, r in rows], indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
