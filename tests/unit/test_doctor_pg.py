"""How ``engram doctor`` judges what it found on a PostgreSQL's pgvector
(:func:`proxy.cli.doctor_pg._vector_check`): the facts come from a real server in
tests/cli/test_pg_cli.py; a pgvector that dies computing a distance (compiled for another CPU)
cannot be made on demand, so its judging is checked here on the facts such a server gives."""

from __future__ import annotations

from dataclasses import replace

from proxy.cli.doctor_pg import _vector_check
from proxy.store.postgres.probe import ServerFacts

FACTS = ServerFacts(
    version="18.6",
    vector_installed="0.8.6",
    vector_available="0.8.6",
    superuser=True,
    schema_versions=[16],
)


def test_an_installed_pgvector_whose_distances_compute_passes() -> None:
    check = _vector_check(FACTS, has_schema=True)
    assert check.ok is True and check.detail == "vector 0.8.6 installed, distances compute"


def test_a_backend_dying_on_a_distance_fails_naming_the_cpu_build() -> None:
    facts = replace(
        FACTS,
        vector_error="consuming input failed: server closed the connection unexpectedly",
        vector_crashed=True,
    )
    check = _vector_check(facts, has_schema=True)
    assert check.ok is False
    assert "computing a distance dropped the connection" in check.detail
    assert "-march=native" in check.detail and 'make OPTFLAGS=""' in check.detail


def test_a_distance_failing_without_a_crash_fails_with_the_servers_words() -> None:
    facts = replace(FACTS, vector_error="permission denied for function l2_normalize")
    check = _vector_check(facts, has_schema=True)
    assert check.ok is False and check.detail.endswith(
        "permission denied for function l2_normalize"
    )
    assert "-march" not in check.detail
