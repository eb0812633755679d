"""Checks every family's loader makes before a state dict is assigned, and the byte-level token
decoding that the built-in and test tokenizers share: one wording for one failure everywhere."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from .interface import CheckpointError


def check_state_dict(expected: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], source,
                     shown: Callable[[str], str] = str) -> None:
    """``tensors`` (our names) must be exactly ``expected``'s keys with its shapes; ``shown`` maps
    our name to the checkpoint's for the message (a family that renames keys on load)."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{source}: tensor {shown(missing[0])} is missing from the checkpoint "
                              f"({len(missing)} missing)")
    for name, t in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {shown(name)}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{source}: tensor {shown(name)} has shape {list(t.shape)}, "
                                  f"config.json implies {list(expected[name].shape)}")


def decode_byte_tokens(ids: Sequence[int], byte_base: int, specials: Mapping[int, str],
                       skip_special_tokens: bool = True) -> str:
    """Text of ids where ``byte_base + b`` is the UTF-8 byte ``b`` (runs of bytes decode together,
    broken sequences as U+FFFD) and ``specials`` maps the other known ids to their text (dropped
    with ``skip_special_tokens``); any other id (a spare of the vocab) is U+FFFD."""
    parts: list[str] = []
    buf = bytearray()
    for i in map(int, ids):
        if byte_base <= i < byte_base + 256:
            buf.append(i - byte_base)
            continue
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
        if i in specials:
            if not skip_special_tokens:
                parts.append(specials[i])
        else:
            parts.append("\ufffd")
    if buf:
        parts.append(buf.decode("utf-8", errors="replace"))
    return "".join(parts)
