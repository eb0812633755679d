"""Attention ops by use, one backend object per kernel: varlen.py, the vision encoder's
block-diagonal attention over packed images (fa3.py: its optional FlashAttention-3 path);
paged.py, the text decoder's prefill/decode attention over the paged KV cache; deformable.py, a
detector's multi-scale deformable sampling."""
