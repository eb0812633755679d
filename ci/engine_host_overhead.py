#!/usr/bin/env python3
"""Host time per decode step, the part a GPU waits for between two graph replays (any CPU).

The engine runs around a runner whose logits cost nothing (a random token per row), so what is
timed is scheduling, batch building, sampling bookkeeping, detokenization/stop checks; then
`DecodeGraphs.stage` (filling a decode graph's inputs) alone. Run from the repo root:
    python3 ci/engine_host_overhead.py [--batches 1,64,256] [--steps 128]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdeploy_ext.device_api import device_api_for  # noqa: E402
from fastdeploy_ext.engine.sampling_params import SamplingParams  # noqa: E402
from fastdeploy_ext.engine.step import SeqStep, StepBatch  # noqa: E402
from fastdeploy_ext.text_runner import DecodeGraphs  # noqa: E402
from tests.engine_fakes import FakeRunner  # noqa: E402
from tests.test_engine_scheduler import make_engine, pil  # noqa: E402


class FreeLogitsRunner(FakeRunner):
    """Logits at no cost: one random token per row; images map to zero features."""

    def __init__(self, vocab: int = 1000):
        super().__init__(vocab=vocab, block_size=64)

    def init_kv_cache(self, num_blocks):
        pass

    def encode_images(self, batch):
        return [torch.zeros((g[1] // 2) * (g[2] // 2), 8) for g in batch.grid_thw]

    def execute(self, step):
        n = sum(s.need_logits for s in step.seqs) if step.is_prefill else len(step.seqs)
        return torch.zeros(n, self.vocab).scatter_(1, torch.randint(0, self.vocab, (n, 1)), 1.0)


def engine_step_ms(batch: int, steps: int) -> float:
    eng = make_engine(FreeLogitsRunner(), max_model_len=4096, max_num_seqs=max(batch, 1), num_kv_blocks=8192)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        eng.add_request(str(i), {"messages": [{"role": "user", "content": [
            {"type": "image", "image": pil(i, 56, 56)}, {"type": "text", "text": "OCR:"}]}]}, params)
    while eng.scheduler.num_running < batch:      # preprocessing, then the one prefill step
        eng.step()
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        n += 1
    dt = time.perf_counter() - t0
    eng.shutdown()
    return dt * 1e3 / n


class _Runner:                                    # what DecodeGraphs reads of a runner
    block_size, num_blocks, device = 64, 20000, torch.device("cpu")
    device_api = device_api_for(device)


def stage_ms(batch: int, reps: int = 50) -> float:
    dg = DecodeGraphs(_Runner(), (batch,), max_model_len=16384)
    step = StepBatch(False, [SeqStep(i, [5], 700 + i, list(range(20 * i, 20 * i + 20)), None, rope_delta=-300)
                             for i in range(batch)])
    dg.stage(step, batch)
    t0 = time.perf_counter()
    for _ in range(reps):
        dg.stage(step, batch)
    return (time.perf_counter() - t0) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6} {'engine step ms':>15} {'us/seq':>8} {'graph stage ms':>15}")
    for b in (int(x) for x in a.batches.split(",")):
        e = engine_step_ms(b, a.steps)
        print(f"{b:>6} {e:>15.3f} {e * 1e3 / b:>8.1f} {stage_ms(b):>15.3f}")


if __name__ == "__main__":
    main()
