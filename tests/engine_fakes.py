"""A fake model runner and prompt builder for unit tests of the scheduler side of the engine.

The fake runner keeps a real paged cache (one float code per KV slot) and computes each row's
logits from what it reads back through the block table, so a wrong block table, start position,
chunk boundary, rope position or image row changes the tokens. Its logits are a pure function
of the sequence's content, so batching, chunking and preemption must not change greedy tokens.
It takes device-resident input ids as the real runner does (a decode row with a prev_row reads
StepBatch.prev_token_ids; on the CPU those are plain tensors), so the engine overlaps its steps
on it unless a test turns async scheduling off. It takes mixed steps (decode rows in a prefill
step) too.

The fake prompt builder speaks the family contract of engine/sequence.py: positions [P, n] with
P = position_rows (3: mrope-like, 1: 1D rope with rope_delta 0), one placeholder per 2x2
patches of an image's grid (its embeddings) and an encoder cost of t*h*w.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastdeploy_ext.engine.step import KVCacheSpec, StepBatch

IMAGE_ID, BOS, EOS = 60, 1, 2
PLACEHOLDER = "<|IMAGE_PLACEHOLDER|>"


class FakeTokenizer:
    def encode(self, text):                 # the ids FakePromptBuilder.build gives text
        return [3 + b % 50 for b in text.encode("utf-8", "surrogatepass")]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i % 26)) for i in ids if not (skip_special_tokens and i in (BOS, EOS, IMAGE_ID)))


@dataclass
class FakePrompt:
    token_ids: list[int]
    positions: torch.Tensor
    rope_delta: int
    image_runs: list[tuple[int, int]] = field(default_factory=list)


class FakePromptBuilder:
    image_token_id = IMAGE_ID
    eos_token_ids = (EOS,)
    vocab_size = 64
    tokenizer = FakeTokenizer()

    def __init__(self, position_rows: int = 3):
        self.position_rows = position_rows

    def render(self, messages):
        out = "<bos>"
        for m in messages:
            c = m["content"]
            parts = [c] if isinstance(c, str) else [PLACEHOLDER if p["type"] == "image" else p["text"] for p in c]
            out += f"{m['role']}: " + "".join(parts) + "\n"
        return out + "Assistant: "

    def output_sizes(self, grids):
        return [t * h * w // 4 for t, h, w in grids]

    def encoder_cost(self, grid):
        t, h, w = grid
        return t * h * w

    def build(self, messages, grids):
        text = self.render(messages)
        ids, pos, runs = [], [], []
        chunks = text.replace("<bos>", "").split(PLACEHOLDER)
        if len(chunks) - 1 != len(grids):
            raise ValueError(f"{len(chunks) - 1} placeholders for {len(grids)} images")
        ids.append(BOS)
        pos.append((0, 0, 0))
        s = 1
        for k, chunk in enumerate(chunks):
            for b in chunk.encode():
                ids.append(3 + b % 50)
                pos.append((s, s, s))
                s += 1
            if k < len(grids):
                t, h, w = grids[k]
                runs.append((len(ids), t * (h // 2) * (w // 2)))
                for i in range(h // 2):
                    for j in range(w // 2):
                        ids.append(IMAGE_ID)
                        pos.append((s, s + i, s + j))
                s += max(h, w) // 2
        positions = torch.tensor(pos, dtype=torch.int64).T.contiguous()
        if self.position_rows == 1:          # 1D rope: a token's position is its index
            positions = torch.arange(len(ids), dtype=torch.int64)[None]
        return FakePrompt(ids, positions, int(positions.max()) + 1 - len(ids), runs)


class FakeRunner:
    device = torch.device("cpu")
    takes_device_token_ids = True
    takes_mixed_steps = True             # decode rows in a prefill step (rope_positions None)

    def __init__(self, vocab: int = 64, block_size: int = 4, position_rows: int = 3):
        self.vocab, self.block_size, self.position_rows = vocab, block_size, position_rows
        self.encode_calls: list[int] = []        # images per vision pass
        self.steps: list[StepBatch] = []
        self.cache = None

    def kv_cache_spec(self):
        return KVCacheSpec(self.block_size, 1, 1, 4, torch.float32)

    def profile_peak_memory(self, *a):
        return 0

    def init_kv_cache(self, num_blocks):
        self.cache = torch.zeros(num_blocks * self.block_size, dtype=torch.float64)
        self.owner = [-1] * (num_blocks * self.block_size)

    def free_kv_cache(self):
        self.cache = None

    def pin_host(self, t):
        return t

    def upload(self, t):
        return t

    def encode_images(self, batch):
        self.encode_calls.append(len(batch.grid_thw))
        out, k = [], 0
        for t, h, w in batch.grid_thw:
            n = t * h * w
            pv = batch.pixel_values[k:k + n].reshape(n // 4, -1).double()
            out.append(pv[:, :8] * 0.5 + pv[:, 8:16])      # [n/4, 8] per image, batch-independent
            k += n
        return out

    def _slot(self, table, pos):
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, step: StepBatch) -> torch.Tensor:
        self.steps.append(step)
        rows = []
        for s in step.seqs:
            pos = s.rope_positions if s.rope_positions is not None else \
                torch.full((self.position_rows, 1), s.start_pos + s.rope_delta, dtype=torch.int64)
            assert pos.shape[0] == self.position_rows, f"rope positions [{pos.shape[0]}, n], not [{self.position_rows}, n]"
            img_rows = iter(s.image_embeds if s.image_embeds is not None else [])
            weights = (1, 3, 7)[:self.position_rows]
            toks = s.token_ids if s.prev_row is None else [int(step.prev_token_ids[s.prev_row])]
            assert all(t >= 0 for t in toks), f"seq {s.seq_id}: a placeholder id reached the model"
            for j, tok in enumerate(toks):
                code = tok * 1000.0 + float(sum(wt * pos[r, j] for r, wt in enumerate(weights)))
                if tok == IMAGE_ID:
                    code += round(float(next(img_rows).sum()), 6)
                slot = self._slot(s.block_table, s.start_pos + j)
                self.cache[slot] = code
                self.owner[slot] = s.seq_id
            if s.image_embeds is not None:
                assert next(img_rows, None) is None, "more image rows than placeholder tokens"
            if s.need_logits:
                end = s.start_pos + len(s.token_ids)
                slots = [self._slot(s.block_table, p) for p in range(end)]
                assert all(self.owner[sl] == s.seq_id for sl in slots), "KV slot owned by another sequence"
                h = hash(tuple(round(float(self.cache[sl]), 4) for sl in slots)) & 0x7FFFFFFF
                rows.append(torch.randn(self.vocab, generator=torch.Generator().manual_seed(h)))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)


class PieceTokenizer:
    """Decodes each id to a fixed piece of text (several characters per token where a test
    needs new text that spans more than one character in one step)."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces.get(i, "") for i in ids
                       if not (skip_special_tokens and i in (BOS, EOS, IMAGE_ID)))


class ScriptedRunner(FakeRunner):
    """The fake paged runner (cache and block-table checks included) whose logits make every
    sequence generate `script` in order (its k-th sampled token is script[k], greedy or not):
    tests that need a known text (stop strings) or a known token at a known step."""

    def __init__(self, script: list[int], **kw):
        super().__init__(**kw)
        self.script = script
        self.emitted: dict[int, int] = {}          # seq_id -> tokens handed out

    def execute(self, step: StepBatch) -> torch.Tensor:
        rows = super().execute(step)
        wanting = [s for s in step.seqs if s.need_logits]
        for row, s in zip(rows, wanting):
            k = self.emitted.get(s.seq_id, 0)
            self.emitted[s.seq_id] = k + 1
            row.fill_(-10.0)
            row[self.script[k % len(self.script)]] = 10.0
        return rows
