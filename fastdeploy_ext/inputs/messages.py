"""Chat messages -> the shape chat templates take: the one place a content part's type is read.

The offline API and the engine's input processor, a family's prompt builder and the server all
normalize through :func:`normalize_messages`, so a part type is accepted everywhere or nowhere.

Accepted content (a message's ``content``: a string, None, or a list of parts):

==========================  =====================================================  ===========
part                        payload                                                from JSON
==========================  =====================================================  ===========
``{"type": "text"}``        ``text``: a string                                     yes
``{"type": "image_url"}``   ``image_url``: ``{"url": URL}`` or the URL (OpenAI)    yes
``{"type": "input_image"}`` ``image_url``: the URL (OpenAI Responses)              yes
``{"type": "image"}``       ``image``: a path, URL, bytes or PIL image; may be     yes (a URL)
                            absent in an already normalized message
``{"type": "image_pil"}``   ``image_pil``: a PIL image (vLLM's offline parts)      no
==========================  =====================================================  ===========

The output's content is always a list of ``{"type": "text", "text"}`` and ``{"type": "image"}``
parts, and the image payloads come back separately in prompt order (what the image processor
reads; a payload is None for a bare ``{"type": "image"}`` part). Normalizing an output again
gives it back unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: image part type -> the key of its payload
IMAGE_PART_TYPES: dict[str, str] = {"image_url": "image_url", "input_image": "image_url", "image": "image",
                                    "image_pil": "image_pil"}
#: the image part types a JSON body can carry (a PIL image has no JSON form)
JSON_IMAGE_PART_TYPES: tuple[str, ...] = ("image_url", "input_image", "image")
PART_TYPES: tuple[str, ...] = ("text", *IMAGE_PART_TYPES)


class MessageError(ValueError):
    """A message or content part of the wrong shape; the message names it (messages[i].content[j])."""


@dataclass
class NormalizedMessages:
    messages: list[dict]                     # content: a list of {"type": "text" | "image"} parts
    images: list[Any] = field(default_factory=list)   # each image part's payload, in order

    @property
    def texts(self) -> list[str]:
        return [p["text"] for m in self.messages for p in m["content"] if p["type"] == "text"]


def image_payload(part: dict, where: str = "part") -> Any:
    """The payload of an image part (the URL of an ``{"url": ...}`` object); None when a bare
    ``{"type": "image"}`` part carries none."""
    kind = part.get("type")
    key = IMAGE_PART_TYPES[kind]
    value = part.get(key)
    if isinstance(value, dict) and kind in ("image_url", "input_image"):
        if not isinstance(value.get("url"), str):
            raise MessageError(f"{where}.{key}.url must be a string")
        return value["url"]
    if value is None and kind != "image":
        raise MessageError(f"{where}: a {kind!r} part needs its {key!r}")
    return value


def normalize_messages(messages: Any) -> NormalizedMessages:
    """OpenAI-style messages -> :class:`NormalizedMessages`; MessageError naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MessageError(f"messages[{i}] must be an object with a string 'role' and a 'content'")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": m["role"], "content": [{"type": "text", "text": content or ""}]})
            continue
        if not isinstance(content, list):
            raise MessageError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise MessageError(f"{where}.text must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                images.append(image_payload(part, where))
                parts.append({"type": "image"})
            else:
                raise MessageError(f"{where}: unsupported part type {kind!r} (supported: {', '.join(PART_TYPES)})")
        out.append({"role": m["role"], "content": parts})
    return NormalizedMessages(out, images)


__all__ = ["IMAGE_PART_TYPES", "JSON_IMAGE_PART_TYPES", "MessageError", "NormalizedMessages", "PART_TYPES",
           "image_payload", "normalize_messages"]
