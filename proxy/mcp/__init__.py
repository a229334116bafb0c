"""Engram's memory as MCP tools for agents, at ``/engram/mcp`` on the proxy's own port.

A hand-written Streamable HTTP server (the official ``mcp`` SDK serves only ASGI; the tests use
it as the client), stateless, speaking the handshake revisions 2025-06-18 and 2025-11-25 and the
stateless 2026-07-28 revision on the same endpoint:

    protocol    JSON-RPC 2.0 messages, the revisions, the request envelope checks (pure)
    schema      the tools' input schemas enforced (pure)
    tools       the tool definitions and the server's instructions (pure data)
    render      what the model reads of each result (pure)
    access      who a request acts for: keys, the admin token, identity headers
    calls       each tool, through the same actions and views as the admin API and the CLI
    dispatch    one message: the method, its era, its answer and HTTP status
    http        the aiohttp edge: the route, body cap, 405s, no OAuth discovery
"""
