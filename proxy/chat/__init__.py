"""The request path of a chat completion, one stage a module, in the order a request meets them.

``pipeline`` (the handler) → ``identity`` (who is asking; housekeeping) → ``sessions`` (which
conversation: placement, and the commit's re-check) → ``recall`` (memories for the new message)
→ ``rewrite`` (budget, tool-result slots, the assembled prompt: ``prompt``, ``fence``) → the
upstream (``proxy.relay``) → ``archive`` (the turn, durable before the client's last byte).
``memory`` holds the stage order; ``turn`` the data that flows through; ``api`` the seam where a
chat API's wire format meets that protocol-neutral data (OpenAI chat is the first adapter).
"""
