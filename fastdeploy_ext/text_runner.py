"""The text half of the runner: StepBatch -> logits over the paged KV cache, and decode graphs.

TorchRunner owns one `TextStepRunner` once a text model is loaded; every method here is
device-agnostic and configured by the plan (text attention backend, KV block size, decode graph
batch sizes). Step metadata is built on the host from the StepBatch's Python ints and uploaded
without a sync (the device API's stage_and_upload: pinned + non-blocking on CUDA).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .device_api import DeviceAPI, device_api_for
from .engine.step import KVCacheSpec, StepBatch
from .models.interface import DecoderModel
from .ops.attention.paged import KVCache, PagedAttentionBackend, PagedStepMeta

log = logging.getLogger(__name__)


class StepError(ValueError):
    """The StepBatch is inconsistent (names the sequence and the problem)."""


@dataclass
class StepInputs:
    token_ids: torch.Tensor          # int64 [T] (device)
    positions: torch.Tensor          # int64 [P, T] prefill (P: the family's position rows), [T] decode (device)
    image_embeds: torch.Tensor | None
    image_index: torch.Tensor | None  # int64 [k] rows of the flat batch
    logits_index: torch.Tensor       # int64 [rows needing logits]
    meta: PagedStepMeta


class TextStepRunner:
    def __init__(self, model: DecoderModel, backend: PagedAttentionBackend, *, block_size: int,
                 device: torch.device, dtype: torch.dtype, image_token_id: int, position_rows: int = 3,
                 device_api: DeviceAPI | None = None):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.device, self.dtype, self.image_token_id = device, dtype, image_token_id
        self.device_api = device_api or device_api_for(device)
        # called a few times per step: the bound method itself (no forwarding frame)
        self.upload = self.device_api.stage_and_upload
        self.position_rows = position_rows      # P of a prefill's [P, n] rope positions (3: mrope)
        cfg = model.cfg
        self.scale = cfg.head_dim ** -0.5
        self.kv: KVCache | None = None
        self.graphs: "DecodeGraphs | None" = None
        self.graph_hits = 0
        self.graph_fallbacks = 0

    # ---------------------------------------------------------------- KV cache
    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.model.cfg
        return KVCacheSpec(self.block_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        """``num_blocks`` usable blocks, plus one scratch block (index num_blocks) that padded
        rows of a graphed decode batch write to, so they never touch a sequence's blocks."""
        if num_blocks < 1:
            raise ValueError(f"init_kv_cache needs at least one block, got {num_blocks}")
        self.free_kv_cache()
        c = self.model.cfg
        self.kv = KVCache.allocate(c.num_hidden_layers, num_blocks + 1, self.block_size, c.num_key_value_heads,
                                   c.head_dim, self.dtype, self.device)
        self.num_blocks = num_blocks
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                 2 * self.kv.k.numel() * self.kv.k.element_size() / 2 ** 20)

    def free_kv_cache(self) -> None:
        self.graphs = None          # graphs hold pointers into the cache
        self.kv = None

    # ---------------------------------------------------------------- host -> device
    def _check(self, step: StepBatch) -> None:
        if self.kv is None:
            raise RuntimeError("no KV cache: call init_kv_cache(num_blocks) first")
        if not step.seqs:
            raise StepError("empty StepBatch")
        bs, nb = self.block_size, self.num_blocks
        for i, s in enumerate(step.seqs[:step.num_decode_rows]):      # a mixed step's leading decode rows
            if not step.is_prefill or len(s.token_ids) != 1 or s.rope_positions is not None:
                raise StepError(f"seq {s.seq_id}: row {i} of a step's {step.num_decode_rows} leading decode rows "
                                f"must be a prefill step's one-token row without rope_positions")
        for s in step.seqs:
            n = len(s.token_ids)
            if n == 0:
                raise StepError(f"seq {s.seq_id}: no tokens")
            if not step.is_prefill and n != 1:
                raise StepError(f"seq {s.seq_id}: a decode step takes exactly one token, got {n}")
            need = (s.start_pos + n + bs - 1) // bs
            if len(s.block_table) < need:
                raise StepError(f"seq {s.seq_id}: {s.start_pos + n} tokens need {need} blocks of {bs}, "
                                f"block table has {len(s.block_table)}")
            table = s.block_table[:need]
            if min(table) < 0 or max(table) >= nb:
                bad = [b for b in table if not 0 <= b < nb]
                raise StepError(f"seq {s.seq_id}: block ids {bad} outside the pool 0..{nb - 1}")
            p_rows = self.position_rows
            if step.is_prefill and s.rope_positions is not None and tuple(s.rope_positions.shape) != (p_rows, n):
                raise StepError(f"seq {s.seq_id}: rope_positions must be [{p_rows}, {n}], "
                                f"got {list(s.rope_positions.shape)}")
            if s.prev_row is not None:
                m = 0 if step.prev_token_ids is None else step.prev_token_ids.shape[0]
                if n != 1 or not 0 <= s.prev_row < m:
                    raise StepError(f"seq {s.seq_id}: prev_row {s.prev_row} needs a decode row (one token) in a "
                                    f"step whose prev_token_ids has that row (it has {m}, {n} tokens)")

    def feed_device_ids(self, token_ids: torch.Tensor, step: StepBatch, offsets: list[int] | None = None) -> None:
        """Rows whose token is the previous step's sampled id get it on the device (token_ids:
        the step's uploaded ids; the token of step.seqs[i] is row offsets[i], default i as in a
        decode step): one small index upload and a gather, no host round trip."""
        pairs = [(i if offsets is None else offsets[i], s.prev_row) for i, s in enumerate(step.seqs)
                 if s.prev_row is not None]
        if not pairs:
            return
        dst, src = self.upload(torch.tensor(pairs, dtype=torch.int64).T.contiguous())
        token_ids.index_copy_(0, dst, step.prev_token_ids.index_select(0, src))

    def build_inputs(self, step: StepBatch) -> StepInputs:
        """The step's device inputs, built on the host with vectorised numpy and TWO uploads
        whatever the number of sequences (every int64 field packed into one buffer, every int32
        one into another; the device tensors are views of them): the torch ops and uploads of a
        prefill of 40 small crops are those of a prefill of two. The per-sequence work left is
        Python bookkeeping (lengths, each block table row written into the packed buffer)."""
        self._check(step)
        bs, seqs, prefill = self.block_size, step.seqs, step.is_prefill
        b = len(seqs)
        qlens = [len(s.token_ids) for s in seqs]
        starts = [s.start_pos for s in seqs]
        ctx = [st + n for st, n in zip(starts, qlens)]
        nblks = [(c + bs - 1) // bs for c in ctx]
        max_blocks = max(nblks)
        t = sum(qlens)
        cu = np.zeros(b + 1, np.int64)
        np.cumsum(qlens, out=cu[1:])
        seq_of = np.repeat(np.arange(b), qlens)                   # token -> its row of the batch
        pos = np.arange(t) - cu[:-1][seq_of] + np.asarray(starts)[seq_of]      # each token's KV position
        ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, t)
        emb = [s.image_embeds for s in seqs if s.image_embeds is not None]
        img_rows = np.empty(0, np.int64)
        if emb:
            has = np.fromiter((s.image_embeds is not None for s in seqs), bool, b)
            img_rows = np.flatnonzero((ids == self.image_token_id) & has[seq_of])
            found = np.bincount(seq_of[img_rows], minlength=b)
            for i in np.flatnonzero(has):
                if found[i] != seqs[i].image_embeds.shape[0]:
                    raise StepError(f"seq {seqs[i].seq_id}: {found[i]} image placeholder tokens in this chunk but "
                                    f"{seqs[i].image_embeds.shape[0]} image embedding rows")
        need = np.fromiter((s.need_logits for s in seqs), bool, b)
        logits_rows = cu[1:][need] - 1
        p_rows = self.position_rows if prefill else 1
        # the int64 buffer: ids | positions [P, T] | slots | image rows | logits rows
        n64 = t * (2 + p_rows) + img_rows.size + logits_rows.size
        h64 = np.empty(n64, np.int64)
        h_ids, h_pos = h64[:t], h64[t:t * (1 + p_rows)].reshape(p_rows, t)
        h_slots = h64[t * (1 + p_rows):t * (2 + p_rows)]
        h_ids[:] = ids
        deltas = np.fromiter((s.rope_delta for s in seqs), np.int64, b)
        h_pos[:] = pos + deltas[seq_of]                # decode rows, and prefill rows without positions
        given = [s.rope_positions for s in seqs if s.rope_positions is not None] if prefill else ()
        if given:       # the family's positions, scattered to their sequences' columns at once
            has_pos = np.fromiter((s.rope_positions is not None for s in seqs), bool, b)
            h_pos[:, np.flatnonzero(has_pos[seq_of])] = (given[0] if len(given) == 1 else torch.cat(given, 1)).numpy()
        # the int32 buffer: block tables [B, max_blocks] (rows padded with block 0) | ctx | cu |
        # a mixed step's prefill chunks' own cu (from 0)
        d_rows = step.num_decode_rows if prefill and 0 < step.num_decode_rows < b else 0
        n32 = b * max_blocks + 2 * b + 1
        h32 = np.zeros(n32 + (b - d_rows + 1 if d_rows else 0), np.int32)
        tables = h32[:b * max_blocks].reshape(b, max_blocks)
        for i, s in enumerate(seqs):
            tables[i, :nblks[i]] = s.block_table[:nblks[i]]
        h_slots[:] = tables[seq_of, pos // bs].astype(np.int64) * bs + pos % bs
        k = t * (2 + p_rows)
        h64[k:k + img_rows.size] = img_rows
        h64[k + img_rows.size:] = logits_rows
        h32[b * max_blocks:b * max_blocks + b] = ctx
        h32[b * max_blocks + b:n32] = cu
        if d_rows:
            h32[n32:] = cu[d_rows:] - d_rows          # each decode row is one token
        d64 = self.upload(torch.from_numpy(h64))
        d32 = self.upload(torch.from_numpy(h32))
        token_ids = d64[:t]
        positions = d64[t:t * (1 + p_rows)].view(p_rows, t) if prefill else d64[t:2 * t]
        d_tables, d_ctx, d_slots = d32[:b * max_blocks].view(b, max_blocks), d32[b * max_blocks:b * max_blocks + b], \
            d64[t * (1 + p_rows):k]
        meta = PagedStepMeta(
            is_prefill=prefill, slot_mapping=d_slots, block_tables=d_tables, context_lens=d_ctx, query_lens=qlens,
            start_pos=starts, block_size=bs, cu_query=d32[b * max_blocks + b:n32], max_query_len=max(qlens),
            max_context_len=max(ctx))
        if d_rows:      # the decode rows through the decode kernel, the chunks through the prefill one
            meta.mixed = (
                PagedStepMeta(False, d_slots[:d_rows], d_tables[:d_rows], d_ctx[:d_rows], qlens[:d_rows],
                              starts[:d_rows], bs, max_context_len=max(ctx[:d_rows])),
                PagedStepMeta(True, d_slots[d_rows:], d_tables[d_rows:], d_ctx[d_rows:], qlens[d_rows:], starts[d_rows:],
                              bs, cu_query=d32[n32:], max_query_len=max(qlens[d_rows:]),
                              max_context_len=max(ctx[d_rows:])))
        embeds = None
        if emb:         # the encoder's rows (on the device already in the engine): one cat, one move
            embeds = (emb[0] if len(emb) == 1 else torch.cat(emb)).to(self.device, non_blocking=True)
        if not prefill:
            self.feed_device_ids(token_ids, step)
        elif step.prev_token_ids is not None:       # a mixed step's decode rows
            self.feed_device_ids(token_ids, step, cu.tolist())
        return StepInputs(token_ids, positions, embeds, d64[k:k + img_rows.size] if img_rows.size else None,
                          d64[k + img_rows.size:], meta)

    # ---------------------------------------------------------------- forward
    def attention(self, meta: PagedStepMeta) -> "PagedAttention":
        return PagedAttention(self, meta)

    def forward(self, inp: StepInputs) -> torch.Tensor:
        m = self.model
        x = m.embed(inp.token_ids, inp.image_embeds, inp.image_index)
        h = m(x, inp.positions, self.attention(inp.meta))
        return m.logits(h.index_select(0, inp.logits_index))

    @torch.no_grad()    # not inference_mode: the engine's sampler edits the logits in place
    def execute(self, step: StepBatch) -> torch.Tensor:
        if not step.is_prefill and self.graphs is not None:
            out = self.graphs.run(step)
            if out is not None:
                self.graph_hits += 1
                return out
            self.graph_fallbacks += 1
        return self.forward(self.build_inputs(step))


class PagedAttention:
    """The decoder's attention over the paged cache for one step, as a family's decoder calls it
    per layer: the backend's prefill or decode function, the cache writes."""

    def __init__(self, runner: TextStepRunner, meta: PagedStepMeta):
        self.kv, self.meta, self.scale = runner.kv, meta, runner.scale
        self.backend = runner.backend
        self.fn = self._mixed if meta.mixed else runner.backend.prefill if meta.is_prefill else runner.backend.decode
        c = runner.model.cfg
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)

    def __call__(self, layer: int, q, k, v):
        self.kv.write(layer, k, v, self.meta.slot_mapping)
        return self.attend_cached(layer, q)

    def write_rotated(self, layer: int, qkv, cos, sin) -> None:
        from .ops.triton.decoder_passes import rope_and_cache
        rope_and_cache(qkv, cos, sin, self.kv.k[layer], self.kv.v[layer], self.meta.slot_mapping, *self.heads)

    def attend_cached(self, layer: int, q):
        return self.fn(q, self.kv.k[layer], self.kv.v[layer], self.meta, self.scale)

    def _mixed(self, q, kc, vc, meta: PagedStepMeta, scale: float):
        """A mixed step: its leading decode rows (one token each) by the decode kernel, which
        batches them (the prefill kernel would give each a block of query rows, the CPU's a call
        per row), the chunks after them by the prefill kernel."""
        dec, pre = meta.mixed
        n = dec.num_seqs
        return torch.cat([self.backend.decode(q[:n], kc, vc, dec, scale), self.backend.prefill(q[n:], kc, vc, pre, scale)])


class DecodeGraphs:
    """One device graph per decode batch-size bucket, captured through the device API (CUDA graphs
    on CUDA). The static inputs (token ids, positions, slot mapping, block tables, context
    lengths) live in fixed buffers sized for the largest bucket and max_model_len; a batch is
    padded to the smallest bucket >= its size, padded rows write to the scratch block and attend
    to one token of it. The attention backend must be graph safe (its launch grid may not depend
    on the step: triton_paged's decode uses the fixed max_model_len partition count)."""

    def __init__(self, runner: TextStepRunner, sizes: tuple[int, ...], max_model_len: int):
        self.r = runner
        self.sizes = tuple(sorted(set(sizes)))
        bs = runner.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        self.max_model_len = self.max_blocks * bs
        dev, n = runner.device, self.sizes[-1]
        # staging and capture through the device API (a host one stages into plain memory and
        # refuses to capture: the tests build these on the CPU to check the staging)
        self.api = api = runner.device_api
        self.scratch = runner.num_blocks            # the extra block init_kv_cache allocated
        # rows 0..2: token id, rope position, KV slot of each row's one new token (int64, one
        # upload); ctx and tables are int32 as the attention kernels read them
        self.scalars = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self.scalars[2].fill_(self.scratch * bs)
        self.ids, self.pos, self.slots = self.scalars[0], self.scalars[1], self.scalars[2]
        self.tables = torch.full((n, self.max_blocks), self.scratch, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        # Every device tensor a graph reads must outlive the capture: a tensor made for one
        # capture and then dropped returns to the allocator, is handed to the next step's
        # tensors, and the replay indexes with whatever they hold (seen on the H200 as index
        # asserts at decode batches > 1). So the logits rows are a persistent buffer too.
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        # Host staging twins, written through numpy views: one bulk write per field instead of
        # a few tensor element writes per row (~18 us a row, 4.5 ms a step at batch 256 on a
        # 2-core Xeon, time the GPU then idles). Pinned (the device API's pin: page-locked on
        # CUDA) so the uploads queue without blocking; an event says when the last step's uploads
        # have left them.
        self.h_scalars = api.pin(torch.zeros(3, n, dtype=torch.int64))
        self.h_ctx = api.pin(torch.ones(n, dtype=torch.int32))
        self.h_tables = api.pin(torch.full((n, self.max_blocks), self.scratch, dtype=torch.int32))
        self._np = (self.h_scalars.numpy(), self.h_ctx.numpy(), self.h_tables.numpy())
        self._uploaded = api.transfer_event()
        self.graphs: dict[int, object] = {}         # bucket -> the device API's graph (replay())
        self.out: dict[int, torch.Tensor] = {}

    def _inputs(self, b: int) -> StepInputs:
        meta = PagedStepMeta(False, self.slots[:b], self.tables[:b], self.ctx[:b], [1] * b, [0] * b,
                             self.r.block_size, max_context_len=self.max_model_len,
                             extras={"graph_max_context": self.max_model_len})
        return StepInputs(self.ids[:b], self.pos[:b], None, None, self.rows[:b], meta)

    def persistent_storages(self) -> set[int]:
        """Data pointers of the buffers replays read (tests check _inputs uses nothing else)."""
        return {t.untyped_storage().data_ptr() for t in (self.scalars, self.tables, self.ctx, self.rows)}

    def capture(self) -> dict:
        t0 = time.perf_counter()
        api = self.api
        pool = api.graph_pool()
        before = api.allocated_bytes()
        with torch.no_grad():
            for b in reversed(self.sizes):           # largest first: later ones reuse its pool
                # warm-up (Triton autotune/compile, allocator) on a fresh side stream; the graph
                # is captured on the device's default capture stream
                self.graphs[b], self.out[b] = api.capture_graph(partial(self.r.forward, self._inputs(b)), pool)
        api.synchronize()
        return {"sizes": list(self.sizes), "seconds": time.perf_counter() - t0,
                "memory_bytes": api.allocated_bytes() - before}

    def stage(self, step: StepBatch, bucket: int) -> None:
        """Write the step's inputs into the host staging buffers, rows b..bucket as padding
        (token 0, the scratch slot, context 1). Table entries past a row's last block stay
        stale: the decode kernel reads blocks below cdiv(ctx, block_size) only."""
        if self._uploaded is not None:
            self._uploaded.synchronize()            # the previous step's uploads have left
        seqs, bs = step.seqs, self.r.block_size
        b = len(seqs)
        sc, ctx, tables = self._np
        starts = [s.start_pos for s in seqs]
        sc[0, :b] = [s.token_ids[0] for s in seqs]
        sc[1, :b] = [p + s.rope_delta for p, s in zip(starts, seqs)]
        sc[2, :b] = [s.block_table[p // bs] * bs + p % bs for p, s in zip(starts, seqs)]
        ctx[:b] = [p + 1 for p in starts]
        for i, (p, s) in enumerate(zip(starts, seqs)):
            n = p // bs + 1
            tables[i, :n] = s.block_table[:n]
        sc[:2, b:bucket] = 0
        sc[2, b:bucket] = self.scratch * bs
        ctx[b:bucket] = 1
        tables[b:bucket, 0] = self.scratch

    def run(self, step: StepBatch) -> torch.Tensor | None:
        b = len(step.seqs)
        bucket = next((s for s in self.sizes if s >= b), None)
        if bucket is None:
            return None
        if any(s.start_pos + 1 > self.max_model_len for s in step.seqs):
            return None
        self.r._check(step)
        self.stage(step, bucket)
        # whole buffers: contiguous host->device copies (a few KiB, one table of max_blocks ints a row)
        self.scalars.copy_(self.h_scalars, non_blocking=True)
        self.ctx.copy_(self.h_ctx, non_blocking=True)
        self.tables[:bucket].copy_(self.h_tables[:bucket], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        self.r.feed_device_ids(self.ids, step)      # the graph's id buffer, on the device
        self.graphs[bucket].replay()
        rows = [i for i, s in enumerate(step.seqs) if s.need_logits]
        out = self.out[bucket]
        if len(rows) == b:
            # the graph's static output is overwritten by the next replay: a caller that keeps
            # logits across steps gets its own copy; the engine, which samples them on the stream
            # before its next step, borrows the buffer (no copy of [b, vocab] a step)
            return out[:b] if step.borrow_logits else out[:b].clone()
        return out.index_select(0, self.r.upload(torch.as_tensor(rows, dtype=torch.int64)))
