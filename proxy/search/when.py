"""The times a search query names, as windows a turn's timestamp can fall in (pure, English).

"What did Evan share with Sam on 9th December 2023?", "Which hobby did Dave pick up in October
2023?", "Which cities did Dave travel to in 2023?", "What did I say about the boiler last
week?": the answer was said at that time, and every stored turn knows when it was said. On
LoCoMo 202 of 1,540 questions name a month or a year, and 190 of the 233 turns they cite were
said in the month named. :func:`query_times` reads:

- a date — "9th December 2023", "9 December, 2023", "December 9, 2023", "2023-12-09" — as that
  day, one day of slack each side (time zones, "late that night");
- a month and year — "August 2023", "Aug. 2023" — as that month; a year — "in 2023" — as that year;
- a month alone after a preposition — "in October", "since May", "early June" — as that month of
  any year (a month name alone may be a name or "may");
- with ``now`` (the request's time): "today", "yesterday", "this/last week|month|year",
  "N days/weeks/months/years ago", "recently". Without it, relative phrases name nothing.

Dates are read in UTC (turn timestamps are Unix seconds). :func:`said_in` tells whether a
timestamp falls in any of the windows.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Window", "query_times", "said_in"]

DAY = 86400.0
_MONTHS = (
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
)  # fmt: skip
_MONTH = r"(?P<{}>jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"  # noqa: E501
_YEAR = r"(?P<{}>(?:19|20)\d\d)(?!\d)"
_DAYNUM = r"(?P<{}>[0-3]?\d)(?:st|nd|rd|th)?"

_DAY_MONTH_YEAR = re.compile(
    r"(?<![\w-])"
    + _DAYNUM.format("d")
    + r"(?:\s+of)?\s+"
    + _MONTH.format("m")
    + r",?\s+"
    + _YEAR.format("y"),
    re.IGNORECASE,
)
_MONTH_DAY_YEAR = re.compile(
    r"(?<![\w-])"
    + _MONTH.format("m")
    + r"\s+"
    + _DAYNUM.format("d")
    + r",?\s+"
    + _YEAR.format("y"),
    re.IGNORECASE,
)
_ISO = re.compile(r"(?<![\w-])(?P<y>(?:19|20)\d\d)-(?P<m>[01]\d)-(?P<d>[0-3]\d)(?![\w-])")
_MONTH_YEAR = re.compile(
    r"(?<![\w-])" + _MONTH.format("m") + r",?\s+(?:of\s+)?" + _YEAR.format("y"), re.IGNORECASE
)
_YEAR_ALONE = re.compile(
    r"\b(?:in|of|during|since|throughout|for|from|by|before|after)\s+" + _YEAR.format("y"),
    re.IGNORECASE,
)
_MONTH_ALONE = re.compile(
    r"\b(?:in|during|since|early|late|mid|last|this|past|next|of|through|until|by)[\s-]+"
    + _MONTH.format("m")
    + r"(?![\w-])",
    re.IGNORECASE,
)
_AGO = re.compile(
    r"\b(?P<n>\d+|a|an|one|two|three|four|five|six|seven|eight|nine|ten|a\s+few|few|couple\s+of"
    r"|a\s+couple\s+of)\s+(?P<unit>day|week|month|year)s?\s+ago\b",
    re.IGNORECASE,
)
_RELATIVE = re.compile(
    r"\b(?:(?P<word>today|tonight|yesterday|recently|lately)|(?P<which>this|last|past)\s+"
    r"(?P<unit>week(?:end)?|month|year))\b",
    re.IGNORECASE,
)
_NUMBERS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "few": 3, "a few": 3, "couple of": 2,
    "a couple of": 2,
}  # fmt: skip
_UNIT_DAYS = {"day": 1.0, "week": 7.0, "month": 30.5, "year": 365.25}


@dataclass(frozen=True, slots=True)
class Window:
    """Unix seconds ``[start, end)``, or, with ``month`` set, that month of any year."""

    start: float = 0.0
    end: float = 0.0
    month: int = 0


def _month(name: str) -> int:
    key = name.lower().rstrip(".")[:3]
    return next(i for i, m in enumerate(_MONTHS, 1) if m.startswith(key))


def _utc(year: int, month: int, day: int = 1) -> float:
    return dt.datetime(year, month, day, tzinfo=dt.UTC).timestamp()


def _month_window(year: int, month: int) -> Window:
    after = _utc(year + month // 12, month % 12 + 1)
    return Window(_utc(year, month), after)


def _day_window(year: int, month: int, day: int) -> Window | None:
    try:
        start = _utc(year, month, day)
    except ValueError:  # 31 February
        return None
    return Window(start - DAY, start + 2 * DAY)


def query_times(query: str, now: float | None = None) -> list[Window]:
    """The windows of time ``query`` names (empty when it names none)."""
    out: list[Window] = []
    taken: list[tuple[int, int]] = []

    def free(m: re.Match[str]) -> bool:
        """Whether a match lies outside every longer one already read."""
        return all(m.end() <= a or m.start() >= b for a, b in taken)

    for rx in (_DAY_MONTH_YEAR, _MONTH_DAY_YEAR, _ISO):
        for m in rx.finditer(query):
            month = int(m["m"]) if m["m"].isdigit() else _month(m["m"])
            window = _day_window(int(m["y"]), month, int(m["d"])) if 1 <= month <= 12 else None
            if window is not None and free(m):
                out.append(window)
                taken.append(m.span())
    for m in _MONTH_YEAR.finditer(query):
        if free(m):
            out.append(_month_window(int(m["y"]), _month(m["m"])))
            taken.append(m.span())
    for m in _YEAR_ALONE.finditer(query):
        if free(m):
            year = int(m["y"])
            out.append(Window(_utc(year, 1), _utc(year + 1, 1)))
            taken.append(m.span())
    for m in _MONTH_ALONE.finditer(query):
        if free(m):
            out.append(Window(month=_month(m["m"])))
            taken.append(m.span())
    if now is not None:
        out.extend(_relative(query, now))
    return out


def _relative(query: str, now: float) -> list[Window]:
    out: list[Window] = []
    today = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0)
    midnight = today.timestamp()
    for m in _AGO.finditer(query):
        n = _NUMBERS.get(" ".join(m["n"].lower().split())) or int(m["n"])
        span = n * _UNIT_DAYS[m["unit"].lower()] * DAY
        out.append(Window(now - span * 1.5 - DAY, now - span * 0.5 + DAY))
    for m in _RELATIVE.finditer(query):
        word = (m["word"] or "").lower()
        if word in ("today", "tonight"):
            out.append(Window(midnight - DAY, now + DAY))
        elif word == "yesterday":
            out.append(Window(midnight - 2 * DAY, midnight + DAY))
        elif word:  # recently, lately
            out.append(Window(now - 30 * DAY, now + DAY))
        else:
            unit = m["unit"].lower()
            days = {"week": 7, "weekend": 7, "month": 31, "year": 366}[unit]
            back = 1 if m["which"].lower() == "this" else 2
            out.append(Window(now - back * days * DAY, now + DAY))
    return out


def said_in(timestamp: float | None, windows: Sequence[Window]) -> bool:
    """Whether ``timestamp`` (Unix seconds) falls in any of ``windows``."""
    if timestamp is None or not windows:
        return False
    month = 0
    for w in windows:
        if w.month:
            if not month:
                month = dt.datetime.fromtimestamp(timestamp, dt.UTC).month
            if month == w.month:
                return True
        elif w.start <= timestamp < w.end:
            return True
    return False
