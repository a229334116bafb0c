"""The inspector's pictures as inline SVG (pure functions): a bar of a prompt's zones, a
sparkline of memory-stage latency, a chart of tokens saved over time. Numbers only go into
attributes and every text is escaped, so nothing stored can inject markup; the page's Content
Security Policy allows no inline style or script, and SVG needs neither.

``width`` and ``height`` are the drawing's coordinates (its viewBox) and the size it has where
nothing says otherwise; the stylesheet fits each chart to its card (issue 39): the drawing
stretches across (``preserveAspectRatio="none"``), keeping its height, and the lines keep
their stroke (``vector-effect="non-scaling-stroke"``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

ZONE_COLOURS = {
    "system": "#8c8c8c",
    "memory": "#2f7ed8",
    "summary": "#8e44ad",
    "recent": "#27ae60",
    "current": "#e67e22",
    "sent": "#c0392b",
    "free": "#ececec",
}


def zone_bar(zones: Mapping[str, int], budget: int | None, width: int = 600) -> str:
    """One horizontal bar: each zone's tokens as a share of the budget (or of the total when
    the budget is unknown), the unused budget in grey; a title on each part says its figures."""
    total = sum(zones.values())
    scale = max(budget or 0, total, 1)
    x, parts = 0.0, []
    for name, tokens in zones.items():
        if tokens <= 0:
            continue
        w = width * tokens / scale
        colour = ZONE_COLOURS.get(name, "#555")
        parts.append(
            f'<rect class="zone zone-{escape(name)}" x="{x:.1f}" y="0" width="{w:.1f}" '
            f'height="18" fill="{colour}" data-zone="{escape(name)}" data-tokens="{tokens}">'
            f"<title>{escape(name)}: {tokens} tokens</title></rect>"
        )
        x += w
    if budget and total < budget:
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{width - x:.1f}" height="18" '
            f'fill="{ZONE_COLOURS["free"]}"><title>unused: {budget - total} tokens</title></rect>'
        )
    label = f"{total} tokens" + (f" of a {budget}-token budget" if budget else "")
    return (
        f'<svg class="zonebar" role="img" aria-label="{escape(label)}" width="{width}" '
        f'height="18" viewBox="0 0 {width} 18" preserveAspectRatio="none">'
        f"{''.join(parts)}</svg>"
    )


def sparkline(values: Sequence[float], width: int = 240, height: int = 36) -> str:
    """A line of ``values`` in order (e.g. memory-stage milliseconds), scaled to its maximum."""
    if len(values) < 2:
        return '<svg class="spark" width="0" height="0"></svg>'
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - 2 - (height - 4) * v / top:.1f}" for i, v in enumerate(values)
    )
    return (
        f'<svg class="spark" role="img" aria-label="{len(values)} values, max {top:.1f}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'preserveAspectRatio="none"><polyline fill="none" stroke="#2f7ed8" stroke-width="1.5" '
        f'vector-effect="non-scaling-stroke" points="{points}"/></svg>'
    )


def saved_chart(
    points: Sequence[tuple[float, int, int]], width: int = 480, height: int = 80
) -> str:
    """Tokens the client sent against tokens forwarded, per request over time (``(at, sent,
    forwarded)``): two lines, the gap between them is what rewriting and slots saved."""
    if len(points) < 2:
        return '<svg class="saved" width="0" height="0"></svg>'
    top = max(max(s, f) for _, s, f in points) or 1
    step = width / (len(points) - 1)

    def line(values: Sequence[int], colour: str, name: str) -> str:
        pts = " ".join(
            f"{i * step:.1f},{height - 2 - (height - 4) * v / top:.1f}"
            for i, v in enumerate(values)
        )
        return (
            f'<polyline class="{name}" fill="none" stroke="{colour}" stroke-width="1.5" '
            f'vector-effect="non-scaling-stroke" points="{pts}"><title>{name}</title></polyline>'
        )

    sent = [s for _, s, _ in points]
    fwd = [f for _, _, f in points]
    saved = sum(sent) - sum(fwd)
    return (
        f'<svg class="saved" role="img" aria-label="{saved} tokens saved over {len(points)} '
        f'requests" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'preserveAspectRatio="none">'
        f"{line(sent, '#c0392b', 'sent by the client')}"
        f"{line(fwd, '#27ae60', 'forwarded')}</svg>"
    )
