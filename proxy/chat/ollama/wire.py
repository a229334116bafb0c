"""Ollama's native chat wire shapes beside the neutral (OpenAI chat) ones (pure).

Ollama's tool calls carry their arguments as JSON objects and (from clients such as the
``ollama`` Python package, which drops unknown fields) no call ids; its tool results name the
tool (``tool_name``), not the call. The neutral shape needs ids on both, and they must be the
same every time the client resends its history (the archive recognises a conversation by the
hash chain over its messages, ids included). So a neutral id is derived from the call itself
(:func:`call_id`: its name, arguments and place in its message), never from an id the client or
the upstream may or may not keep, and the reply's calls get the id their resend will get.

Images (``images``: base64 strings) become ``image_url`` parts with a data URL, the neutral
shape of an image; :func:`split_content` turns parts back into Ollama's text and images.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from proxy.messages import content_text

# Base64 openings of the image formats Ollama's vision models take, for the data URL's type.
_IMAGE_TYPES = (
    ("iVBORw0KGgo", "image/png"),
    ("/9j/", "image/jpeg"),
    ("R0lGOD", "image/gif"),
    ("UklGR", "image/webp"),
)


def arguments_json(arguments: Any) -> str:
    """A tool call's arguments as the neutral JSON string: an object serialised with its keys in
    the order sent (the same text every time the same call is resent), a string kept as is."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def call_id(name: str, arguments: str, index: int) -> str:
    """The neutral id of a tool call: nine alphanumerics (what Mistral's chat templates demand)
    from its name, its arguments and its place among its message's calls."""
    seed = f"{name}\0{arguments}\0{index}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(seed).hexdigest()[:9]


def neutral_call(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    """An Ollama tool call (``{"function": {"name", "arguments": {...}}}``) in the neutral shape."""
    fn = call.get("function")
    fn = fn if isinstance(fn, Mapping) else {}
    name = fn.get("name")
    name = name if isinstance(name, str) else ""
    arguments = arguments_json(fn.get("arguments"))
    return {
        "id": call_id(name, arguments, index),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def ollama_call(call: Mapping[str, Any], index: int, with_id: bool = False) -> dict[str, Any]:
    """A neutral (OpenAI) tool call in Ollama's shape: arguments as an object (an argument string
    that is not a JSON object becomes ``{}``, what Ollama's clients can hold)."""
    fn = call.get("function")
    fn = fn if isinstance(fn, Mapping) else {}
    raw = fn.get("arguments")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) and raw.strip() else raw
    except ValueError:
        arguments = None
    out: dict[str, Any] = {
        "function": {
            "index": index,
            "name": fn.get("name") if isinstance(fn.get("name"), str) else "",
            "arguments": arguments if isinstance(arguments, dict) else {},
        }
    }
    if with_id and isinstance(call.get("id"), str) and call["id"]:
        out = {"id": call["id"], **out}
    return out


def image_part(data: str) -> dict[str, Any]:
    """An Ollama image (base64) as the neutral ``image_url`` part."""
    kind = next((t for prefix, t in _IMAGE_TYPES if data.startswith(prefix)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{data}"}}


def image_data(part: Mapping[str, Any]) -> str | None:
    """The base64 data of a neutral image part (None for another part)."""
    if part.get("type") != "image_url":
        return None
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str):
        return None
    head, sep, data = url.partition(",")
    return data if sep and head.startswith("data:") else url


def neutral_content(content: str, images: list[str]) -> str | list[dict[str, Any]]:
    """Ollama's text and images as neutral content: the text alone, or parts when it has images."""
    if not images:
        return content
    parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    return parts + [image_part(i) for i in images]


def split_content(content: Any) -> tuple[str, list[str]]:
    """Neutral content as Ollama's text and images (text parts joined as they are: a block
    Engram put before or after the client's text keeps that text byte-identical)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        return "", []
    texts: list[str] = []
    images: list[str] = []
    for part in content:
        if isinstance(part, Mapping):
            data = image_data(part)
            if data is not None:
                images.append(data)
            elif isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                texts.append(content_text([part]))
        elif isinstance(part, str):
            texts.append(part)
    return "".join(texts), images


def now_iso() -> str:
    """A ``created_at`` as Ollama writes it (UTC, with a ``Z``)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def usage_of(obj: Mapping[str, Any]) -> dict[str, int] | None:
    """Ollama's counts as OpenAI usage: ``prompt_eval_count`` (the prompt, cached tokens
    included in current Ollama) and ``eval_count`` (the reply). A count Ollama left out (it omits
    zeros) is left out here too, so no one learns from a prompt of 0 tokens."""
    usage: dict[str, int] = {}
    for theirs, ours in (
        ("prompt_eval_count", "prompt_tokens"),
        ("eval_count", "completion_tokens"),
    ):
        value = obj.get(theirs)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            usage[ours] = value
    if not usage:
        return None
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return usage
