"""Paddle tensors in, Paddle tensors out: how a FastDeploy (PaddlePaddle) worker calls a runner.

FastDeploy's PaddleOCR-VL worker holds the preprocessed pixel values as a Paddle tensor and each
image's (t, h, w) as host integers. `PaddleVisionAdapter(runner).encode_images(pixels, grid_thw)`
hands the pixels to the runner through DLPack and returns one Paddle tensor per image, also through
DLPack: where the pixel tensor is already on the runner's device in its compute dtype, the runner
reads the Paddle buffer itself (same data pointer), and the features Paddle receives are the
runner's own output buffers (same data pointers) — no copies either way. Otherwise the runner's
usual upload (device move, dtype cast) makes the one copy it must.

grid_thw must be host values (Python ints, a NumPy array, or a CPU tensor): a device tensor
would need a device->host sync to read, which the host metadata path exists to avoid.

Paddle is imported on first use, never when fastdeploy_ext is imported (the `paddle` extra:
`pip install 'fastdeploy_ext[paddle]'`, paddlepaddle 3.3.1, the CPU wheel is enough for tests).
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..models.interface import BatchError
from ..runner import ImageBatch

if TYPE_CHECKING:
    from ..runner import DeviceRunner

log = logging.getLogger(__name__)


def _paddle():
    try:
        return importlib.import_module("paddle")
    except ImportError as e:
        raise ImportError(f"the Paddle adapter needs paddlepaddle (pip install 'fastdeploy_ext[paddle]'): {e}") from e


def is_paddle_tensor(x: Any) -> bool:
    """Without importing paddle: a module that never imported it cannot hold its tensors."""
    return type(x).__module__.startswith("paddle") and hasattr(x, "__dlpack__")


def to_torch(x) -> torch.Tensor:
    """A Paddle tensor as a torch tensor over the same memory (DLPack, no copy)."""
    if not is_paddle_tensor(x):
        raise TypeError(f"expected a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")
    return torch.utils.dlpack.from_dlpack(x)


def to_paddle(t: torch.Tensor):
    """A torch tensor as a Paddle tensor over the same memory (DLPack, no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return _paddle().utils.dlpack.from_dlpack(t.detach())


def host_grids(grid_thw) -> list[tuple[int, int, int]]:
    """Each image's (t, h, w) as Python ints, from ints, a NumPy array or a CPU tensor (Paddle or
    torch); a tensor on an accelerator is refused instead of silently synchronising."""
    if is_paddle_tensor(grid_thw) or isinstance(grid_thw, torch.Tensor):
        t = to_torch(grid_thw) if is_paddle_tensor(grid_thw) else grid_thw
        if t.device.type != "cpu":
            raise BatchError(f"grid_thw must be host values (ints, NumPy or a CPU tensor), got a tensor on {t.device}: "
                             "reading it would be a device->host sync; pass the preprocessor's host grid")
        grid_thw = t.tolist()
    elif hasattr(grid_thw, "tolist"):          # NumPy
        grid_thw = grid_thw.tolist()
    try:
        return [tuple(int(v) for v in g) for g in grid_thw]
    except (TypeError, ValueError) as e:
        raise BatchError(f"grid_thw must be a sequence of (t, h, w) integer triples: {e}") from None


class PaddleVisionAdapter:
    """Calls a runner's vision path (encoder + projector) with Paddle tensors."""

    def __init__(self, runner: "DeviceRunner"):
        self.runner = runner

    def encode_images(self, pixel_values, grid_thw: Sequence) -> list:
        """pixel_values: paddle.Tensor [N, C, P, P] or [N, C*P*P] (floating point), all images'
        patches concatenated; grid_thw: per image (t, h, w), host values. Returns one
        paddle.Tensor [t*h*w/4, text_hidden] per image, in the runner's compute dtype, on its device."""
        pixels = to_torch(pixel_values)
        feats = self.runner.encode_images(ImageBatch(pixels, host_grids(grid_thw)))
        return [to_paddle(f) for f in feats]
