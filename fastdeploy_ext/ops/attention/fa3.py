"""Optional FlashAttention-3 forward (the `fa3-fwd` wheel, `pip install fastdeploy_ext[fa3]`) for
the vision varlen attention on Hopper, with a per-batch choice against the Triton kernel (the
``fa3_varlen`` backend object lives with the others in ops/attention/varlen.py).

Why both: FA3's warp-specialised wgmma kernel is faster on long sequences (a 1080p page, 10764
tokens, head_dim 72 run in its 96-wide kernel: 1.115 ms per layer vs 1.54 for our Triton kernel)
but slower on batches of many short blocks (64 small blocks of <= 320 tokens: 32.8 vs 30.8 ms
for the whole encoder); both measured on the H200, docs/PERFORMANCE.md,
where our kernel's rotary fusion and tile scheduling win. So ``LengthDispatch`` picks per batch
from the host int ``max_seqlen`` (no sync): FA3 when the longest sequence has at least
``FD_FA3_MIN_SEQLEN`` tokens, the Triton kernel otherwise.

Graph safety: FA3 is never captured. Under CUDA graph capture the dispatch takes the Triton
kernel (graph-safe, with its padded block table), whatever the length; FA3 runs only in eager
passes (batches above the graph budgets, e.g. pages). FA3's own capture safety is therefore not
relied on.

The wheel (0.0.3, built for torch 2.10, abi3) ships its config module as ``fa3_fwd_config``
while its interface imports ``flash_attn_config``: ``load_fa3`` registers the alias before
importing the interface (only if no real ``flash_attn_config`` is already importable).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from ... import envs

log = logging.getLogger(__name__)

INTERFACE_MODULE = "fa3_fwd_interface"
CONFIG_MODULE = "fa3_fwd_config"
CONFIG_ALIAS = "flash_attn_config"


@functools.cache
def load_fa3() -> tuple[ModuleType | None, str]:
    """(interface module, reason) or (None, why not). Cached: the import is tried once."""
    try:
        if importlib.util.find_spec(INTERFACE_MODULE) is None:
            return None, f"{INTERFACE_MODULE} not installed (pip install fastdeploy_ext[fa3], i.e. fa3-fwd)"
        if CONFIG_ALIAS not in sys.modules and importlib.util.find_spec(CONFIG_ALIAS) is None:
            # the wheel's interface imports flash_attn_config, which the wheel ships as fa3_fwd_config
            sys.modules[CONFIG_ALIAS] = importlib.import_module(CONFIG_MODULE)
        mod = importlib.import_module(INTERFACE_MODULE)
    except Exception as e:  # noqa: BLE001 - a broken optional extra must not break the runner
        return None, f"{INTERFACE_MODULE} failed to import ({type(e).__name__}: {e})"
    if not callable(getattr(mod, "flash_attn_varlen_func", None)):
        return None, f"{INTERFACE_MODULE} has no flash_attn_varlen_func"
    return mod, f"{INTERFACE_MODULE} imported from {getattr(mod, '__file__', '?')}"


def fa3_dtypes(mod: ModuleType) -> tuple[str, ...]:
    """dtypes the installed build has kernels for (fa3-fwd 0.0.3 is built without fp16)."""
    flags = {}
    try:
        flags = sys.modules[CONFIG_ALIAS].CONFIG["build_flags"]
    except (KeyError, AttributeError):
        pass
    return ("bfloat16",) if flags.get("FLASHATTENTION_DISABLE_FP16") else ("bfloat16", "float16")


def fa3_available(device: torch.device) -> tuple[bool, str]:
    """Importable, and a Hopper GPU (FA3's kernels are sm90-only)."""
    if device.type != "cuda":
        return False, f"FlashAttention-3 needs a CUDA device, have {device.type}"
    mod, why = load_fa3()
    if mod is None:
        return False, why
    cc = torch.cuda.get_device_capability(device)
    if cc[0] != 9:
        return False, f"FlashAttention-3 kernels are for sm90 (Hopper), device is sm{cc[0]}{cc[1]}"
    from ..triton.runtime import triton_available
    ok, twhy = triton_available()   # the short-batch path and the rotary pre-pass are Triton kernels
    if not ok:
        return False, f"the Triton kernels it dispatches to are unavailable: {twhy}"
    return True, f"{why}; dtypes {', '.join(fa3_dtypes(mod))}"


def fa3_varlen(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """FA3 over [N, H, D] q/k/v (strided views are read as they are), non-causal."""
    mod, why = load_fa3()
    if mod is None:
        raise RuntimeError(f"FlashAttention-3 unavailable: {why}")
    out = mod.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale)
    return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class Choice:
    kernel: str      # "long" or "short"
    reason: str


@dataclass(frozen=True)
class LengthDispatch:
    """An attention function that picks, per batch, a long-sequence kernel or a short-sequence one.

    ``long_fn(q, k, v, meta, scale)`` takes q/k already rotated (``rotate`` rotates them in place);
    ``short_fn(q, k, v, meta, scale, cos=, sin=)`` applies the rotary itself. Both see the same
    q/k/v views, so the strided and dense layouts give the same bits for a given choice."""
    long_fn: Callable
    short_fn: Callable
    rotate: Callable             # rotate(q, k, cos, sin), in place
    min_seqlen: int
    long_name: str = "fa3"
    short_name: str = "triton_rope_varlen"

    def choose(self, max_seqlen: int, capturing: bool) -> Choice:
        if capturing:
            return Choice("short", f"{self.short_name}: inside CUDA graph capture ({self.long_name} is never captured)")
        if max_seqlen >= self.min_seqlen:
            return Choice("long", f"{self.long_name}: longest sequence {max_seqlen} >= {self.min_seqlen} tokens")
        return Choice("short", f"{self.short_name}: longest sequence {max_seqlen} < {self.min_seqlen} tokens")

    def __call__(self, q, k, v, meta, scale: float, cos=None, sin=None):
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        c = self.choose(meta.max_seqlen, capturing)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("attention dispatch (%d tokens, %d segments): %s", q.shape[0], len(meta.seq_lens), c.reason)
        if c.kernel == "short":
            return self.short_fn(q, k, v, meta, scale, cos=cos, sin=sin)
        self.rotate(q, k, cos, sin)
        return self.long_fn(q, k, v, meta, scale)


def fa3_min_seqlen() -> int:
    return envs.FD_FA3_MIN_SEQLEN.get()
