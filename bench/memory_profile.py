"""Where a memory-on request's time goes, stage by stage, in process.

    .venv/bin/python -m bench.memory_profile [--turns 10000] [--requests 300] [--mode read-only]

The database of ``bench.memory_load`` (10,000 LoCoMo-synthesised turns of one user, built once
into the cache folder; a copy is used) behind the real services (``proxy.services``: store,
MiniLM, retriever, memory stages) with ``python -m testing.fake_upstream`` as the upstream.
Each request is what ``bench.memory_load`` sends (a system message and one numbered LoCoMo
question), given straight to ``MemoryService.before_forward`` (and, with ``--mode on``, archived
by ``MemoryService.commit`` with a short reply), one at a time: no HTTP, so what is timed is the
memory path alone. Every stage is wrapped in a timer that records its wall time and, for what
runs on a thread (the store's readers, the embedder's lanes), the thread's CPU time; the table
gives each stage's p50 and mean per request, and what the whole path took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine, machine_lines
from bench.memory_load import USER, cached_db, load, query_embedding

_times: dict[str, list[float]] = defaultdict(list)  # stage -> wall seconds, this request
_cpu: dict[str, list[float]] = defaultdict(list)  # stage -> thread CPU seconds, this request


def _wrap_async(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:  # not in this tree
        return

    @functools.wraps(fn)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _times[name].append(time.perf_counter() - t0)

    setattr(owner, attr, timed)


def _wrap_sync(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:  # not in this tree
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _times[name].append(time.perf_counter() - t0)
            _cpu[name].append(time.thread_time() - c0)

    setattr(owner, attr, timed)


def instrument() -> None:
    """Timers around every stage of the memory path (module attributes, as called)."""
    from proxy.chat import fence, memory, recall, rewrite
    from proxy.chat.recall import Recall
    from proxy.chat.rewrite import Rewriter
    from proxy.search import retrieval
    from proxy.search.embedder import FastEmbedEmbedder
    from proxy.search.retrieval import Retriever
    from proxy.store import queries, term_cache, vec_cache
    from proxy.store.store import Store

    _wrap_sync(memory, "chain_hashes", "hash messages (chain_hashes)")
    _wrap_sync(memory, "place", "placement (place, on a reader)")
    _wrap_sync(memory, "is_housekeeping", "housekeeping check")
    _wrap_async(Rewriter, "compose", "rewrite.compose (all below)")
    _wrap_async(Rewriter, "budget", "  budget")
    _wrap_async(Rewriter, "message_sizes", "  message sizes")
    _wrap_sync(rewrite, "assemble", "  prompt.assemble (draft + final)")
    _wrap_sync(rewrite, "memory_block", "  fence.memory_block")
    _wrap_async(Recall, "recall", "  recall.recall (all below)")
    _wrap_sync(Recall, "texts", "    recall.texts (present hashes)")
    _wrap_async(Retriever, "search", "    Retriever.search (all below)")
    _wrap_async(Retriever, "_uncommon", "      common words")
    _wrap_async(Store, "fts_search", "      fts_search (await)")
    _wrap_sync(term_cache.TermCache, "search", "        BM25 in memory (reader)")
    _wrap_async(Store, "vec_search", "      vec_search (await, after embedding)")
    _wrap_sync(vec_cache, "knn", "        KNN in memory (reader)")
    _wrap_async(Store, "get_turns", "      get_turns (await)")
    _wrap_sync(queries, "get_turns", "        get_turns (reader)")
    _wrap_sync(retrieval, "turn_rows", "      candidate rows (reader)")
    _wrap_async(Retriever, "_candidates", "      candidates (+ FTS-only vectors)")
    _wrap_sync(retrieval, "scored_fusion", "      scored_fusion")
    _wrap_sync(retrieval, "scored_order", "      scored_fusion")
    _wrap_async(Recall, "neighbours", "    neighbours (await)")
    _wrap_sync(queries, "turns_at", "      turns_at (reader)")
    _wrap_async(Recall, "repeated", "    repeated paragraphs")
    _wrap_async(Recall, "pinned", "    pinned")
    _wrap_sync(recall, "words_recalled", "    words_recalled")
    _wrap_sync(Recall, "not_in", "  recall.not_in")
    _wrap_sync(FastEmbedEmbedder, "_embed_sync", "query embedding (model, its thread)")
    _wrap_sync(fence, "memory_line", "    fence.memory_line")


@contextlib.contextmanager
def request_stages(out: dict[str, list[float]], cpu_out: dict[str, list[float]]) -> Iterator[None]:
    _times.clear()
    _cpu.clear()
    yield
    for name, values in _times.items():
        out[name].append(sum(values))
    for name, values in _cpu.items():
        cpu_out[name].append(sum(values))


async def run(args: argparse.Namespace) -> None:
    from proxy.chat.api import Conversation
    from proxy.config import load_settings
    from proxy.services import open_services
    from proxy.upstream import UpstreamInfo

    convs, questions, _ = load_locomo(args.data)
    texts = [q.question for q in questions]
    random.Random(1).shuffle(texts)
    embedding = await query_embedding(texts) if args.embedding else None
    source = await cached_db(args.turns, args.cache_dir, convs)
    if args.stages:
        instrument()
    with tempfile.TemporaryDirectory(prefix="engram-profile-") as tmp:
        db = Path(tmp) / "load.db"
        shutil.copyfile(source, db)
        fake = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "testing.fake_upstream", "--host", "127.0.0.1", "--port", "0",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert fake.stdout is not None
        upstream = (await fake.stdout.readline()).decode().split()[-1]
        settings = load_settings(overrides={"memory": {"db_path": str(db)}})
        try:
            async with open_services(
                settings, UpstreamInfo(upstream, "llamacpp", "configured", 4096)
            ) as services:
                memory = services.memory
                assert memory is not None and services.store is not None
                await services.store.preload()
                await asyncio.sleep(args.settle)  # the user's terms and vectors load
                stages: dict[str, list[float]] = defaultdict(list)
                cpu: dict[str, list[float]] = defaultdict(list)
                total: list[float] = []
                total_cpu: list[float] = []
                headers = {"X-Engram-User": USER}
                profiler = cProfile.Profile() if args.cprofile else None
                for i in range(args.requests + args.warmup):
                    if profiler is not None and i == args.warmup:
                        profiler.enable()
                    question = f"{texts[i % len(texts)]} ({i})"
                    messages = [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": question},
                    ]
                    conv = Conversation({"messages": messages}, messages, "fake-model", False, 32)
                    t0, c0 = time.perf_counter(), time.process_time()
                    with request_stages(stages, cpu) if i >= args.warmup else nullcm():
                        mt = await memory.before_forward(headers, conv, args.mode)
                        if args.mode == "on":
                            reply = {"role": "assistant", "content": f"An answer ({i})."}
                            await memory.commit(mt, reply, True)
                    if i >= args.warmup:
                        total.append(time.perf_counter() - t0)
                        total_cpu.append(time.process_time() - c0)
                    await asyncio.sleep(args.gap)
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(args.cprofile)
        finally:
            fake.terminate()
            await fake.wait()
    print("\n".join(machine_lines(machine())))
    print(f"load at the end {load()}; {args.requests} requests, memory {args.mode}")
    if embedding is not None:
        print(
            f"query embedding alone: p50 {embedding['p50']:.2f} ms, CPU {embedding['cpu']:.2f} ms"
        )
    print()
    print("| stage | p50 wall | mean wall | mean thread CPU | share of the path (mean) |")
    print("|---|---|---|---|---|")
    whole = statistics.fmean(total) * 1000
    print(f"| whole path | {statistics.median(total) * 1000:.2f} ms | {whole:.2f} ms | "
          f"{statistics.fmean(total_cpu) * 1000:.2f} ms (process) | 100 % |")  # fmt: skip
    for name, values in stages.items():
        mean = statistics.fmean(values) * 1000
        c = f"{statistics.fmean(cpu[name]) * 1000:.2f} ms" if name in cpu else "-"
        print(f"| {name} | {statistics.median(values) * 1000:.2f} ms | {mean:.2f} ms | {c} | "
              f"{100 * mean / whole:.0f} % |")  # fmt: skip


@contextlib.contextmanager
def nullcm() -> Iterator[None]:
    yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--mode", default="read-only", choices=("read-only", "on"))
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between requests")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds for caches to load")
    parser.add_argument("--no-embedding", dest="embedding", action="store_false")
    parser.add_argument(
        "--no-stages", dest="stages", action="store_false", help="no timers (for a profiler)"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--cprofile", help="write the event loop's cProfile stats here")
    args = parser.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
