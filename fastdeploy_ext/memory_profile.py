"""Peak activation memory of one full step (vision pass + prefill), for sizing the KV pool.

Where the device API reports allocator statistics (CUDA, and MACA's CUDA-compatible torch) it
is measured: a dummy vision pass over
``max_encoder_patches`` patches and a dummy prefill of ``max_num_batched_tokens`` tokens, with the
allocator's peak read before and after; the temporary KV blocks the prefill needs are not
counted (the engine sizes the KV pool separately). Elsewhere it is an estimate from the model's
shapes (the host API reports none: the CPU has no allocator statistics worth trusting).
"""
from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)


def _grid_for(patches: int, merge: int) -> tuple[int, int, int]:
    """A (1, h, w) grid with h*w <= patches, h and w multiples of merge, near square."""
    side = max(merge, int(math.isqrt(patches)) // merge * merge)
    w = max(merge, patches // side // merge * merge)
    return 1, side, w


def estimate_peak_bytes(runner, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
    el = torch.empty((), dtype=runner.dtype).element_size()
    vc, tc = runner.cfg.vision, runner.cfg.text
    # vision: residual + LN + qkv + attention out + MLP intermediate live at once, per patch
    vision = max_encoder_patches * (4 * vc.hidden_size + 3 * vc.hidden_size + vc.intermediate_size) * el
    # text: residual, normed input, qkv, attention out, gate/up + activation, per token
    q = tc.num_attention_heads * tc.head_dim
    kv = tc.num_key_value_heads * tc.head_dim
    text = max_num_batched_tokens * (3 * tc.hidden_size + q + 2 * kv + q + 3 * tc.intermediate_size) * el
    logits = 256 * tc.vocab_size * 4          # a decode batch's float32 logits (default max_num_seqs)
    return int(max(vision, text + logits) * 1.5)   # 1.5: allocator slack and temporaries


def profile_peak_memory(runner, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
    api = runner.device_api
    if not api.allocator_stats:
        est = estimate_peak_bytes(runner, max_num_batched_tokens, max_encoder_patches)
        log.info("peak step memory (estimate on %s: the %s device API reports no allocator statistics): %.1f MiB",
                 runner.device.type, api.name, est / 2 ** 20)
        return est
    from .engine.step import SeqStep, StepBatch
    from .runner import ImageBatch
    text = runner._require_text()
    api.synchronize()
    api.reset_peak_allocated()
    base = api.allocated_bytes()
    merge = runner.cfg.vision.spatial_merge_size
    grid = _grid_for(max_encoder_patches, merge)
    vc = runner.cfg.vision
    pv = torch.zeros(grid[1] * grid[2], vc.num_channels, vc.patch_size, vc.patch_size)
    runner.encode_images(ImageBatch(pv, [grid]))
    api.synchronize()
    vision_peak = api.peak_allocated_bytes() - base

    had_kv = text.kv is not None
    if had_kv:
        raise RuntimeError("profile_peak_memory runs before init_kv_cache (it uses a temporary cache)")
    bs = text.block_size
    n = max_num_batched_tokens
    blocks = (n + bs - 1) // bs
    text.init_kv_cache(blocks)
    kv_bytes = 2 * text.kv.k.numel() * text.kv.k.element_size()
    api.synchronize()
    api.reset_peak_allocated()
    base2 = api.allocated_bytes()
    step = StepBatch(True, [SeqStep(0, [0] * n, 0, list(range(blocks)), None)])
    text.execute(step)
    api.synchronize()
    text_peak = api.peak_allocated_bytes() - base2
    text.free_kv_cache()
    api.empty_cache()
    peak = max(vision_peak, text_peak)
    log.info("peak step memory (measured): vision %d patches %.1f MiB, prefill %d tokens %.1f MiB "
             "(temporary KV %.1f MiB not counted)", grid[1] * grid[2], vision_peak / 2 ** 20, n,
             text_peak / 2 ** 20, kv_bytes / 2 ** 20)
    return int(peak)


def detector_reservation(layout, batch: int, page_hw: tuple[int, int]):
    """Device memory to keep free beside the engine for a layout detector in the same process:
    the peak of one detector pass over ``batch`` blank pages of ``page_hw`` (height, width), as a
    Decision(bytes, reason) for LLMEngine(reserved_memory=...). Runs after the detector is loaded
    and before the engine measures free memory, so the detector's weights are already out of
    the free figure the engine reads (named in the reason, not reserved twice) and the pass's
    activations, which the engine could not see, are what is reserved. Where the device API
    reports no allocator statistics nothing is reserved: such a device has no free-memory query
    either, so its KV pool comes from --kv-cache-memory, not from what is free."""
    import numpy as np

    from .plan import Decision
    api = layout.runner.device_api
    if not api.allocator_stats:
        return Decision(0, f"nothing reserved for the layout detector: the {api.name} device API reports no "
                           "allocator statistics (the KV pool is not sized from free memory there)")
    detector = getattr(layout.runner, "detector", None)
    weights = sum(p.numel() * p.element_size() for p in detector.parameters()) if detector is not None else 0
    h, w = page_hw
    pages = [np.full((h, w, 3), 255, dtype=np.uint8) for _ in range(batch)]
    api.synchronize()
    api.empty_cache()
    api.reset_peak_allocated()
    base = api.allocated_bytes()
    layout.detect(pages, threshold=1.0)
    api.synchronize()
    peak = max(0, api.peak_allocated_bytes() - base)
    api.empty_cache()           # the pass's cached blocks back to the device before the engine reads free
    log.info("layout detector: one batch of %d pages %dx%d peaks at %.1f MiB above its weights (%.1f MiB)",
             batch, w, h, peak / 2 ** 20, weights / 2 ** 20)
    return Decision(int(peak), f"the layout detector's pass over a batch of {batch} pages {w}x{h} "
                               f"(measured peak {peak / 2 ** 30:.2f} GiB; its weights, {weights / 2 ** 30:.2f} GiB, "
                               "are loaded first and so already out of free memory)")
