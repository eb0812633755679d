"""The N1's own vision attention kernel, contributed to fastdeploy_ext's table by AcmeRunner.kernel_backends.

``acme_sdpa``: one SDPA launch over the whole packed batch with a block-diagonal mask (where the
built-in ``sdpa`` loops over images), standing in for the fused attention an N1 SDK would ship.
Its kernel reads dense q/k/v only, so the plan keeps the dense layout; its per-batch state is
each token's image index, built from the host's sequence lengths (no device sync) by prepare().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdeploy_ext.ops.attention.varlen import VarlenAttention


class AcmeBlockDiagonalSdpa(VarlenAttention):
    name = "acme_sdpa"
    reads_strides = False        # the N1 kernel takes contiguous q/k/v
    graph_safe = False
    head_dims = (1, 256)

    def available(self, device: torch.device) -> tuple[bool, str]:
        # the emulated N1 runs on the host (runner.py); a real one would be its own torch device
        if device.type in ("cpu", "meta"):
            return True, f"Acme block-diagonal SDPA on {device.type} (the emulated N1)"
        return False, f"the Acme kernel runs on the N1 (emulated on the host), not on {device.type}"

    def prepare(self, seq_lens: list[int], upload) -> torch.Tensor:
        """Each token's image index, from host ints."""
        return upload(torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)))

    def __call__(self, q, k, v, meta, scale: float, cos=None, sin=None):
        image = meta.attention_state
        mask = image[:, None] == image[None, :]           # a token sees its own image only
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)


ACME_SDPA = AcmeBlockDiagonalSdpa()
