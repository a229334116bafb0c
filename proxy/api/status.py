"""Engram's own status routes: ``GET /engram/health`` (its state, the upstream's) and
``GET /engram/metrics`` (counters in Prometheus' text format)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from aiohttp import web

from proxy import __version__
from proxy.cli.workers import worker_number
from proxy.masking import display_url
from proxy.redact import redact
from proxy.services import SERVICES, Services
from proxy.store.store import Store


async def health(request: web.Request) -> web.Response:
    """Engram's own state and whether the upstream answers. Unguarded, so it shows the
    upstream's URL without user, password or query, and no secret in the probe's detail."""
    services = request.app[SERVICES]
    upstream = services.upstream
    reachable, detail = await upstream.probe()
    info = upstream.info
    memory = _memory_health(services)
    healthy = reachable and (memory is None or memory["up"])
    return web.json_response(
        {
            "status": "ok" if healthy else "degraded",
            "version": __version__,
            "uptime_s": round(time.time() - services.started, 1),
            "upstream": {
                "url": display_url(info.url),
                "kind": info.kind,
                "found_by": info.found_by,
                "reachable": reachable,
                "detail": redact(detail),
                "context_size": info.context_size,
            },
            "memory": memory,  # null: memory is off
            "background_tasks": len(services.tasks),
            "worker": worker_number(),  # of `engram serve --workers N`; null: the only process
            # Where new tool-result slots go ("embedded" also while a configured Redis is down).
            "slots": services.slots.backend if services.slots is not None else None,
        }
    )


def _memory_health(services: Services) -> dict[str, Any] | None:
    """The memory store's backend and whether it answers (no URL: this route is unguarded)."""
    memory = services.pipeline.memory
    if memory is None:
        return None
    store = memory.store
    gate = store.gate.state()
    return {
        "backend": store.backend,
        "up": gate.up,
        "down_for_s": gate.down_for_s,
        "retry_in_s": gate.next_try_s,
        "error": None if gate.up else redact(gate.last_error),
    }


def _store_metrics(store: Store) -> dict[str, float]:
    """The store's connections and the database's availability (proxy.store.gate)."""
    gate = store.gate.state()
    backend = f'{{backend="{store.backend}"}}'
    return {
        f"engram_store_up{backend}": float(gate.up),
        "engram_store_outages_total": gate.outages,
        "engram_store_refused_total": gate.refused,  # jobs refused at once while down
        "engram_store_readers": store.readers,
        "engram_store_connections": store.connections.count,
        "engram_store_connections_opened_total": store.connections.opened,
        "engram_store_reads_in_flight": store.reads_in_flight,
        "engram_store_writes_in_flight": store.writes_in_flight,
    }


async def metrics(request: web.Request) -> web.Response:
    """Counters in Prometheus' text format."""
    services = request.app[SERVICES]
    pipeline, tasks = services.pipeline, services.tasks
    counts: Counter[str] = Counter()  # summed over the chat APIs
    for each in services.pipelines.values():
        counts.update(each.counts)
    values: dict[str, float] = {
        "engram_uptime_seconds": round(time.time() - services.started, 1),
        "engram_background_tasks": len(tasks),
        "engram_background_tasks_failed_total": tasks.failed,
    }
    for mode in ("on", "off", "read-only", "write-only"):
        values[f'engram_chat_requests_total{{mode="{mode}"}}'] = counts[f"chat_{mode}"]
    for name, each in services.pipelines.items():
        total = sum(
            each.counts[f"chat_{mode}"] for mode in ("on", "off", "read-only", "write-only")
        )
        values[f'engram_chat_api_requests_total{{api="{name}"}}'] = total
    for name in (
        "client_disconnects",
        "upstream_failures",
        "memories_injected",
        "memory_failures",
        "archive_failures",
        "fts_only",  # limits.recall_deadline: the query vector came too late
        "recall_timeout",  # … and full-text search too
        "too_many_messages",  # limits.max_messages
        "over_budget",  # the request alone fills the context: forwarded as sent
        "no_room",  # memories found, none fitting in what the request leaves
        # what the model server said it computed and reused of the prompts (proxy.costs),
        # over the requests where it said both
        "upstream_prompt_reports",
        "upstream_prompt_tokens_computed",
        "upstream_prompt_tokens_reused",
    ):
        values[f"engram_{name}_total"] = counts[name]
    activity = services.activity  # Engram's own calls wait for an idle upstream (proxy.idle)
    values["engram_upstream_requests_in_flight"] = activity.in_flight
    values["engram_own_calls_waiting"] = activity.waiting
    values["engram_own_calls_delayed_total"] = activity.delayed
    values["engram_own_calls_forced_total"] = activity.forced
    memory = pipeline.memory
    if memory is not None:
        values.update(_store_metrics(memory.store))
        values["engram_turns_archived_total"] = memory.archived_turns
        # single-shot requests quoting a live conversation: a client's side request
        values["engram_client_tasks_total"] = memory.client_tasks
        indexer = memory.indexer
        values["engram_embed_failures_total"] = indexer.failures if indexer else 0
        values["engram_index_queue_turns"] = indexer.queued if indexer else 0
        values["engram_index_deferred_total"] = indexer.deferred if indexer else 0
        values["engram_turns_over_cap_total"] = memory.quota.refused
        if services.counters is not None:
            for name, value in services.counters.current().items():
                values[f"engram_{name}_total"] = value
        if services.consolidator is not None:
            values["engram_facts_stored_total"] = services.consolidator.facts_stored
        # other processes on the database (--workers, engram import): proxy.store.changes
        follower = memory.store.follower
        values["engram_changes_applied_total"] = follower.applied
        values["engram_changes_cleared_total"] = follower.cleared
        if memory.summarizer is not None:
            values["engram_leases_refused_total"] = memory.summarizer.leases.refused
    expander = pipeline.expander
    if expander is not None:
        for name in ("round_trips", "expanded", "expired"):
            values[f"engram_expansion_{name}_total"] = expander.counts[name]
        slots = expander.slots
        if slots.settings.redis_url:
            values["engram_slots_redis_up"] = float(slots.backend == "redis")
        for cap, refused in slots.quota.refused.items():
            values[f'engram_slots_refused_total{{cap="{cap}"}}'] = refused
        for backend, kinds in slots.counters().items():
            for name, value in kinds.items():
                values[f'engram_slots_{name}_total{{backend="{backend}"}}'] = value
    text = "".join(f"{k} {v:g}\n" for k, v in values.items())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")
