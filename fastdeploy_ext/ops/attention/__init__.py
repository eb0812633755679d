"""Attention ops by use: varlen.py, the vision encoder's block-diagonal attention over packed
images (one backend object per kernel). The engine adds paged prefill/decode attention here."""
