"""Tool-result slots: old bulky tool outputs forwarded as ``[TOOL_RESULT:id]`` references.

``refs`` decides which outputs become references and how they read (pure); ``expand`` is the
expansion tool and the filtering of the model's replies (pure); ``loop`` runs the round trips
that answer the model's calls to it, in each chat API's shapes as its ``dialect`` says;
``model`` is the :class:`~proxy.slots.model.Slot` they all share; ``store`` keeps the slots
(:class:`~proxy.slots.store.SlotStore`: Redis through ``redis``, with failover to the embedded
SQLite table through ``embedded``).
"""
