"""The inspector: a web page at ``/engram/`` that shows what Engram remembers, what it sent and
why, and lets a person correct it (server-rendered with Jinja2; one small script; no CDN, no
build step). Signing in: :mod:`.signin`; the edges (templates, headers, access, forms): :mod:`.web`;
pages: :mod:`.pages` and :mod:`.explain`; corrections: :mod:`.forms` (each one call of
:mod:`proxy.api.actions`); pictures: :mod:`.charts`; routes: :mod:`.routes`."""
