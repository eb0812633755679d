"""Our Triton kernels, one file per kernel family: runtime.py (the guarded import and the
decorator every kernel goes through), varlen_attention.py (the vision encoder's one-launch
varlen attention, its block table and launcher), layer_passes.py (add+LayerNorm and q/k rotary
passes). Callers use the ops of their role (ops/attention, ops/norm.py, ops/rotary.py)."""
