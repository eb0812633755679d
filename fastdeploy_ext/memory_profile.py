"""Peak activation memory of one full step (vision pass + prefill), for sizing the KV pool.

Where the device API reports allocator statistics (CUDA, and MACA's CUDA-compatible torch) it
is measured: a dummy vision pass over the largest image batch one step's ``max_encoder_patches``
admits, in the model family's own pixel/grid form (ModelFamily.profile_images), and a dummy
prefill of ``max_num_batched_tokens`` tokens, with the allocator's peak read before and after;
the temporary KV blocks the prefill needs are not counted (the engine sizes the KV pool
separately). Elsewhere it is an estimate from the model's shapes, the family's figures
(ModelFamily.activation_bytes): the host API reports none (the CPU has no allocator statistics
worth trusting).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def decoder_prefill_bytes(tokens: int, *, hidden: int, q: int, kv: int, intermediate: int,
                          element_size: int) -> int:
    """A decoder layer's live activations over ``tokens`` (the families' estimates share it):
    residual, normed input, qkv, attention out, gate/up + activation, per token. ``q`` / ``kv``:
    the query / key-value widths (heads x head_dim)."""
    return tokens * (3 * hidden + q + 2 * kv + q + 3 * intermediate) * element_size


def estimate_peak_bytes(runner, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
    el = torch.empty((), dtype=runner.dtype).element_size()
    family, cfg = runner.family, runner.cfg
    vision, text = family.activation_bytes(cfg, max_num_batched_tokens, max_encoder_patches, el)
    logits = 256 * family.vocab_size(cfg) * 4          # a decode batch's float32 logits (default max_num_seqs)
    return int(max(vision, text + logits) * 1.5)   # 1.5: allocator slack and temporaries


def profile_peak_memory(runner, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
    api = runner.device_api
    if not api.allocator_stats:
        est = estimate_peak_bytes(runner, max_num_batched_tokens, max_encoder_patches)
        log.info("peak step memory (estimate on %s: the %s device API reports no allocator statistics): %.1f MiB",
                 runner.device.type, api.name, est / 2 ** 20)
        return est
    from .engine.step import SeqStep, StepBatch
    text = runner._require_text()
    api.synchronize()
    api.reset_peak_allocated()
    base = api.allocated_bytes()
    family, cfg = runner.family, runner.cfg
    batch = family.profile_images(cfg, max_encoder_patches)     # the largest batch one step admits
    cost = sum(family.encoder_cost(cfg, g) for g in batch.grid_thw)
    runner.encode_images(batch)
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
    log.info("peak step memory (measured): vision %d images of encoder cost %d (budget %d) %.1f MiB, prefill %d "
             "tokens %.1f MiB (temporary KV %.1f MiB not counted)", len(batch.grid_thw), cost, max_encoder_patches,
             vision_peak / 2 ** 20, n,
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
