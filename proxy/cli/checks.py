"""One line of ``engram doctor``'s report (:mod:`proxy.cli.doctor`, :mod:`proxy.cli.doctor_pg`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not applicable, skipped
    detail: str

    def line(self) -> str:
        status = {True: "ok", False: "FAIL", None: "skip"}[self.ok]
        return f"{status:<5}{self.name:<12}{self.detail}"
