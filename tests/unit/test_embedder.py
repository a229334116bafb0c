"""Embedders: the caching machinery (with the hash fake) and the offline MiniLM model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from proxy.search.embedder import (
    DEFAULT_MODEL,
    PREVIOUS_DEFAULT,
    Embedder,
    FastEmbedEmbedder,
    HashEmbedder,
    Kind,
    assemble_minilm,
    assemble_minilm_q8,
    create_embedder,
)
from proxy.search.model_files import quantizes_per_call
from proxy.vectors import Vector


async def embed_alone(text: str) -> np.ndarray:
    fresh = HashEmbedder()
    try:
        (vec,) = await fresh.embed_passages([text])
        return vec
    finally:
        await fresh.aclose()


class Recording(HashEmbedder):
    """A hash embedder that records every batch and the thread it ran on."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.batches: list[tuple[Kind, list[str]]] = []
        self.threads: set[int] = set()

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        self.batches.append((kind, list(texts)))
        self.threads.add(threading.get_ident())
        return super()._embed_sync(kind, texts)


@pytest.mark.asyncio
async def test_hash_embedder_is_deterministic_normalised_and_word_based() -> None:
    e = HashEmbedder()
    try:
        assert isinstance(e, Embedder) and e.dim == 384 and e.name == "hash-384"
        a, b, c, empty = await e.embed_passages(
            ["the red fox jumps", "The red fox sleeps", "quarterly tax filing", ""]
        )
        assert a.dtype == np.float32 and a.shape == (384,)
        for v in (a, b, c, empty):
            assert float(np.linalg.norm(v)) == pytest.approx(1.0, abs=1e-6)
        assert float(a @ b) > float(a @ c)
        np.testing.assert_array_equal(a, await embed_alone("the red fox jumps"))
    finally:
        await e.aclose()


@pytest.mark.asyncio
async def test_dedup_batching_lru_and_worker_thread() -> None:
    e = Recording(batch_size=2, lru_size=3)
    e.symmetric = False  # as a model that prefixes queries or passages
    try:
        out = await e.embed_passages(["a", "b", "a", "c", "b"])
        assert [kind for kind, _ in e.batches] == ["passage", "passage"]
        assert [texts for _, texts in e.batches] == [["a", "b"], ["c"]]  # each text once
        np.testing.assert_array_equal(out[0], out[2])
        assert threading.get_ident() not in e.threads and len(e.threads) == 1

        e.batches.clear()
        await e.embed_passages(["a", "c"])  # served by the LRU
        assert e.batches == []
        await e.embed_queries(["a"])  # queries and passages are cached apart
        assert e.batches == [("query", ["a"])]
        e.batches.clear()
        await e.embed_passages(["d", "e"])  # evicts the oldest entries (lru_size=3)
        await e.embed_passages(["b"])
        assert e.batches == [("passage", ["d", "e"]), ("passage", ["b"])]
        assert not out[0].flags.writeable  # cached vectors are shared, so read-only
        assert await e.embed_passages([]) == []
        with pytest.raises(TypeError):
            await e.embed_passages("not a list")
    finally:
        await e.aclose()
    same = Recording(lru_size=3)  # symmetric (the hash embedder ignores the kind)
    try:
        await same.embed_queries(["user: a"])
        await same.embed_passages(["user: a"])  # the query's vector, from the cache
        assert same.batches == [("query", ["user: a"])]
    finally:
        await same.aclose()


@pytest.mark.asyncio
async def test_batches_group_similar_lengths_and_keep_input_order() -> None:
    e = Recording(batch_size=2)
    try:
        texts = ["a much longer text than the rest", "tiny", "medium text", "wee"]
        out = await e.embed_passages(texts)
        assert [t for _, t in e.batches] == [["wee", "tiny"], ["medium text", texts[0]]]
        for text, vec in zip(texts, out, strict=True):
            np.testing.assert_array_equal(vec, await embed_alone(text))
    finally:
        await e.aclose()


@pytest.mark.asyncio
async def test_calls_in_a_lane_take_turns_between_batches() -> None:
    e = Recording(batch_size=10)
    try:
        big = asyncio.create_task(e.embed_passages([f"big text {i}" for i in range(100)]))
        await asyncio.sleep(0)  # the big call has sent its first batch
        await e.embed_passages(["small one", "small two"])
        order = [texts[0].split()[0] for _, texts in e.batches]
        assert order.index("small") < 3 and not big.done()  # not behind the other nine
        await big
    finally:
        await e.aclose()


def test_create_embedder() -> None:
    assert isinstance(create_embedder("hash"), HashEmbedder)
    fe = create_embedder()
    assert isinstance(fe, FastEmbedEmbedder) and fe.name == DEFAULT_MODEL and fe.dim == 384


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_assemble_minilm_folder(model_cache: Path) -> None:
    folder = assemble_minilm(model_cache)
    names = {p.name for p in folder.iterdir()}
    assert {
        "model.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    } <= names
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 256 and config["pad_token"] == "[PAD]"
    stamp = (folder / "model.onnx").stat().st_mtime_ns
    assert assemble_minilm(model_cache) == folder  # second call reuses the folder
    assert (folder / "model.onnx").stat().st_mtime_ns == stamp


@pytest.mark.asyncio
async def test_minilm_offline_vectors_are_sane(model_cache: Path) -> None:
    e = FastEmbedEmbedder(cache_dir=model_cache)
    try:
        await e.load()
        texts = [
            "The cat sits on the mat.",
            "A cat is sitting on a rug.",
            "Stock markets fell sharply after the announcement.",
        ]
        cat, cat2, stocks = await e.embed_queries(texts)
        assert cat.shape == (384,) and cat.dtype == np.float32
        assert float(np.linalg.norm(cat)) == pytest.approx(1.0, abs=1e-4)
        assert float(cat @ cat2) > 0.6
        assert float(cat @ cat2) > float(cat @ stocks) + 0.4
        # padding in a batch with a longer text does not change a vector
        long_text = "word " * 200
        batch = await e.embed_passages([texts[0], long_text])
        fresh = FastEmbedEmbedder(cache_dir=model_cache, lru_size=0)
        try:
            (alone,) = await fresh.embed_passages([texts[0]])
        finally:
            await fresh.aclose()
        assert float(batch[0] @ alone) > 0.999
    finally:
        await e.aclose()


@pytest.mark.asyncio
async def test_a_query_does_not_wait_behind_a_passage_batch(model_cache: Path) -> None:
    """Queries have a lane (thread and model session) of their own: one query returns in
    milliseconds while a batch of long passages is still being embedded."""
    e = FastEmbedEmbedder(cache_dir=model_cache, lru_size=0, batch_size=64)
    try:
        await e.load()
        texts = [f"passage {i} " + "word " * 250 for i in range(64)]  # one job, 100s of ms
        batch = asyncio.create_task(e.embed_passages(texts))
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        (vec,) = await e.embed_queries(["where is the lighthouse?"])
        took = time.perf_counter() - t0
        assert vec.shape == (384,)
        assert not batch.done(), f"the query ({took:.2f} s) waited for the batch"
        await batch
    finally:
        await e.aclose()


def test_assemble_minilm_q8_folder(model_cache: Path) -> None:
    """The default model's folder: the same tokenizer, a model whose products run in int8."""
    folder = assemble_minilm_q8(model_cache)
    assert quantizes_per_call(folder / "model.onnx")
    assert not quantizes_per_call(assemble_minilm(model_cache) / "model.onnx")
    assert (folder / "tokenizer.json").read_bytes() == (
        assemble_minilm(model_cache) / "tokenizer.json"
    ).read_bytes()
    stamp = (folder / "model.onnx").stat().st_mtime_ns
    assert assemble_minilm_q8(model_cache) == folder  # built once
    assert (folder / "model.onnx").stat().st_mtime_ns == stamp


@pytest.mark.asyncio
async def test_q8_vectors_match_the_float_model_and_ignore_their_batch(model_cache: Path) -> None:
    """int8 products keep a sentence's vector within cosine 0.98 of the float model's (a word
    or two: 0.93; "Thanks!" measured 0.949), and a text's
    vector is the same alone as beside others in a batch (activations are quantised per call,
    so the default model sees one text at a time)."""
    texts = [
        "I adopted a grey cat named Miso from the shelter last spring.",
        "Our flight to Tokyo was delayed by six hours, so we slept at the gate.",
        "Thanks!",
        "My sister moved to Lisbon and works as a marine biologist. " * 6,
    ]
    q8 = FastEmbedEmbedder(DEFAULT_MODEL, cache_dir=model_cache, lru_size=0, batch_size=4)
    f32 = FastEmbedEmbedder(PREVIOUS_DEFAULT, cache_dir=model_cache, lru_size=0)
    try:
        fast, slow = await q8.embed_passages(texts), await f32.embed_passages(texts)
        for text, a, b in zip(texts, fast, slow, strict=True):
            assert float(a @ b) > (0.98 if len(text) > 20 else 0.93), text
        for text, vec in zip(texts, fast, strict=True):
            (alone,) = await q8.embed_passages([text])
            np.testing.assert_array_equal(vec, alone)
        assert q8.name != f32.name  # different vectors: different model names
    finally:
        await q8.aclose()
        await f32.aclose()


@pytest.mark.asyncio
async def test_the_bundled_model_is_symmetric_and_a_query_serves_its_passage(
    model_cache: Path,
) -> None:
    """Both lanes give a text the same vector bit for bit (what ``symmetric`` promises), so a
    passage already embedded as a query comes from the cache: a chat's user turn is archived
    with the text its recall query was embedded from (retrieval.vector_text)."""
    texts = ["user: What instrument do I play?", "user: Where did we go in May?"]
    plain = FastEmbedEmbedder(DEFAULT_MODEL, cache_dir=model_cache, lru_size=0)
    cached = FastEmbedEmbedder(DEFAULT_MODEL, cache_dir=model_cache)
    try:
        assert plain.symmetric and cached.symmetric
        queries, passages = await plain.embed_queries(texts), await plain.embed_passages(texts)
        for q, p in zip(queries, passages, strict=True):
            np.testing.assert_array_equal(q, p)
        asked = await cached.embed_queries(texts)
        calls: list[list[str]] = []
        real = cached._embed_batch

        def counting(kind: Kind, batch: list[str]) -> list[Vector]:
            calls.append(batch)
            return real(kind, batch)

        cached._embed_batch = counting  # type: ignore[method-assign]
        stored = await cached.embed_passages([*texts, "user: a text never asked"])
        assert [v is a for v, a in zip(stored, asked, strict=False)] == [True, True]
        assert calls == [["user: a text never asked"]]  # only the new text reached the model
    finally:
        await plain.aclose()
        await cached.aclose()
