"""Per-batch metadata of the packed vision pass, built two separate ways.

* host path (:meth:`MetadataBuilder.build_host`): every image's (t, h, w) is a Python int from
  the preprocessor; cu_seqlens, split sizes and the merge permutation are computed on the host
  and uploaded in one pinned, non-blocking copy (the attention backend's own per-batch state,
  e.g. the Triton block table, in another); position embeddings, rotary tables and each size's
  merge order come from a per-(h, w) LFU cache (a batch's new sizes created together). No
  device->host synchronisation.
* device path (:meth:`MetadataBuilder.build_device`): the reference behaviour — everything
  derived with tensor ops from a grid_thw tensor that lives on the device; sizes are read back
  with ``int()``/``tolist()`` (syncs, by design: this is what transformers does).

Both must agree bit for bit (conformance checks it); they share only the elementwise leaf
functions (rotary table gather, position-embedding taps), never the index derivation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F

from ...ops.pos_embed import LFUCache, resample, taps_and_weights
from ...ops.rotary import RotaryTable
from ...transfer import upload
from ..interface import BatchError

if TYPE_CHECKING:
    from ...ops.attention.varlen import VarlenAttention

Grid = tuple[int, int, int]


@dataclass
class VisionMetadata:
    num_tokens: int                      # packed patches N
    seq_lens: list[int]                  # attention segment lengths (one per frame), host ints
    cu_seqlens: torch.Tensor             # int32 [segments + 1], on device
    max_seqlen: int
    cos: torch.Tensor                    # fp32 [N, head_dim]
    sin: torch.Tensor                    # fp32 [N, head_dim]
    pos_embed: torch.Tensor              # [N, hidden] in compute dtype
    merge_index: torch.Tensor            # int64 [N]: packed order -> 2x2-merge order
    out_split_sizes: list[int]           # projector tokens per image
    grids: list[Grid]
    source: str                          # "host" | "device" | "graph"
    attention_state: Any = None          # the attention backend's per-batch state (its prepare())


def validate_grids(grids: Sequence[Sequence[int]], merge: int, num_patches: int | None = None) -> list[Grid]:
    if len(grids) == 0:
        raise BatchError("empty batch: at least one image is needed")
    out = []
    for i, g in enumerate(grids):
        if len(g) != 3:
            raise BatchError(f"image {i}: grid_thw must be (t, h, w), got {tuple(g)}")
        t, h, w = (int(x) for x in g)
        if t < 1 or h < 1 or w < 1:
            raise BatchError(f"image {i}: grid_thw {t, h, w} has a non-positive dimension")
        if h % merge or w % merge:
            raise BatchError(f"image {i}: grid h={h}, w={w} must be divisible by the merge size {merge}")
        out.append((t, h, w))
    if num_patches is not None:
        expected = sum(t * h * w for t, h, w in out)
        if expected != num_patches:
            raise BatchError(f"pixel_values hold {num_patches} patches but grid_thw describes {expected}")
    return out


class MetadataBuilder:
    """Owns the rotary table and the (h, w) cache for one model instance on one device."""

    def __init__(self, *, head_dim: int, rope_theta: float, merge: int, side: int,
                 pos_table: torch.Tensor, compute_dtype: torch.dtype, device: torch.device,
                 cache_capacity: int = 64, attention: "VarlenAttention | None" = None):
        self.merge, self.side = merge, side
        self.pos_table = pos_table            # [side*side, hidden], the learned embedding
        self.dtype, self.device = compute_dtype, device
        self.rotary = RotaryTable(head_dim, rope_theta, device)
        self.cache: LFUCache[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = LFUCache(cache_capacity)
        self.attention = attention            # its prepare() adds the backend's per-batch state

    # ---------------------------------------------------------------- host path
    def _upload(self, cpu: torch.Tensor) -> torch.Tensor:
        return upload(cpu, self.device)

    def _create_tables(self, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], tuple]:
        """The tables of several frame sizes at once (what ``_per_image_tables`` creates for one):
        one host taps computation, two uploads, one rotary lookup and one resample for all of
        them, split per size (each cloned, so that a cached size does not keep the others'
        tensors alive). A step of document crops has a new size nearly every image: created one
        by one each costs ~80 torch calls (each a launch or an op), batched a few per size. The
        values are elementwise the same computations, so bitwise equal to one by one."""
        m = self.merge
        sizes = [h * w for h, w in shapes]
        rows = torch.cat([torch.arange(h).repeat_interleave(w) for h, w in shapes])
        cols = torch.cat([torch.arange(w).repeat(h) for h, w in shapes])
        hs = torch.repeat_interleave(torch.tensor([h for h, _ in shapes]), torch.tensor(sizes))
        ws = torch.repeat_interleave(torch.tensor([w for _, w in shapes]), torch.tensor(sizes))
        idx, wts = taps_and_weights(rows, cols, hs, ws, self.side)
        n = rows.numel()
        packed = self._upload(torch.cat([rows, cols, idx.flatten()]))
        rows_d, cols_d, idx_d = packed[:n], packed[n:2 * n], packed[2 * n:].view(-1, 4)
        wts_d = self._upload(wts)
        self.rotary.ensure(max(max(hw) for hw in shapes))
        cos, sin = self.rotary.lookup(rows_d, cols_d)
        pos = resample(self.pos_table, idx_d, wts_d, self.dtype)
        parts = zip(pos.split(sizes), cos.split(sizes), sin.split(sizes))
        return {(h, w): (p.clone(), c.clone(), si.clone(),
                         torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).flatten())
                for (h, w), (p, c, si) in zip(shapes, parts)}

    def _per_image_tables(self, h: int, w: int):
        """(pos_embed [h*w, D], cos, sin, merge order) for one frame of size h x w: the first
        three on the device in raster order, the last a host int64 tensor of raster indices in
        (block row, block col, i, j) order."""
        def create():
            m = self.merge
            order = torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).flatten()
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            # sizes as full tensors, like the device path: a scalar divisor may be turned into a
            # reciprocal multiply by some kernels, which would break host == device bitwise
            idx, wts = taps_and_weights(rows, cols, torch.full_like(rows, h), torch.full_like(cols, w), self.side)
            packed = self._upload(torch.cat([rows, cols, idx.flatten()]))
            rows_d, cols_d, idx_d = packed[:h * w], packed[h * w:2 * h * w], packed[2 * h * w:].view(-1, 4)
            wts_d = self._upload(wts)
            self.rotary.ensure(max(h, w))
            cos, sin = self.rotary.lookup(rows_d, cols_d)
            return resample(self.pos_table, idx_d, wts_d, self.dtype), cos, sin, order
        return self.cache.get_or_create((h, w), create)

    def build_host(self, grids: Sequence[Grid]) -> VisionMetadata:
        m = self.merge
        seq_lens = [h * w for t, h, w in grids for _ in range(t)]
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        n_tok = cu[-1]
        frames = [(h, w) for t, h, w in grids for _ in range(t)]
        new = list(dict.fromkeys(hw for hw in frames if hw not in self.cache))
        made = self._create_tables(new) if len(new) > 1 else {}      # the batch's new sizes at once
        tables = [self.cache.get_or_create(hw, lambda v=made[hw]: v) if hw in made else self._per_image_tables(*hw)
                  for hw in frames]
        pos, cos, sin, order = (torch.cat([tb[i] for tb in tables]) if len(tables) > 1 else tables[0][i]
                                for i in range(4))
        # merge permutation, host side: each frame's cached (bh, bw, i, j) order, shifted by the
        # frame's first token (a few vectorised ops instead of several per image)
        cu_t = torch.tensor(cu, dtype=torch.int64)
        perm = order + torch.repeat_interleave(cu_t[:-1], torch.tensor(seq_lens))
        packed = self._upload(torch.cat([cu_t, perm]))
        cu_d = packed[:len(cu)].to(torch.int32)
        merge_index = packed[len(cu):]
        meta = VisionMetadata(
            num_tokens=n_tok, seq_lens=seq_lens, cu_seqlens=cu_d, max_seqlen=max(seq_lens),
            cos=cos, sin=sin, pos_embed=pos, merge_index=merge_index,
            out_split_sizes=[t * h * w // (m * m) for t, h, w in grids], grids=list(grids), source="host")
        if self.attention is not None:
            meta.attention_state = self.attention.prepare(seq_lens, self._upload)
        return meta

    # -------------------------------------------------------------- device path
    def build_device(self, grid_thw: torch.Tensor) -> VisionMetadata:
        """Reference path: metadata from a device tensor with tensor ops (syncs where sizes are
        needed on the host, exactly like transformers)."""
        g = grid_thw.to(self.device, torch.int64)
        t, h, w = g[:, 0], g[:, 1], g[:, 2]
        frame_hw = torch.repeat_interleave(h * w, t)
        cu_seqlens = F.pad(frame_hw.cumsum(0), (1, 0)).to(torch.int32)
        n_tok = int(cu_seqlens[-1])                                   # sync (reference)
        frame_starts = torch.repeat_interleave(cu_seqlens[:-1].long(), frame_hw)
        frame_h = torch.repeat_interleave(torch.repeat_interleave(h, t), frame_hw)
        frame_w = torch.repeat_interleave(torch.repeat_interleave(w, t), frame_hw)
        within = torch.arange(n_tok, device=self.device) - frame_starts
        rows, cols = within // frame_w, within % frame_w
        self.rotary.ensure(int(torch.maximum(h, w).max()))          # sync (reference)
        cos, sin = self.rotary.lookup(rows, cols)
        idx, wts = taps_and_weights(rows, cols, frame_h, frame_w, self.side)
        pos = resample(self.pos_table, idx, wts, self.dtype)
        # merge order: sort tokens by (frame, block row, block col, in-row, in-col)
        m = self.merge
        key_block = (rows // m) * (frame_w // m) + cols // m
        in_block = (rows % m) * m + cols % m
        merge_pos = frame_starts + key_block * (m * m) + in_block    # destination slot of each token
        merge_index = torch.empty_like(merge_pos)
        merge_index[merge_pos] = torch.arange(n_tok, device=self.device)
        seq_lens = frame_hw.tolist()                                   # sync (reference)
        out_split = (g.prod(-1) // (m * m)).tolist()                   # sync (reference)
        grids = [tuple(x) for x in g.tolist()]                         # sync (reference)
        meta = VisionMetadata(
            num_tokens=n_tok, seq_lens=seq_lens, cu_seqlens=cu_seqlens, max_seqlen=max(seq_lens),
            cos=cos, sin=sin, pos_embed=pos, merge_index=merge_index, out_split_sizes=out_split,
            grids=grids, source="device")
        if self.attention is not None:
            meta.attention_state = self.attention.prepare(seq_lens, lambda cpu: cpu.to(self.device))
        return meta
