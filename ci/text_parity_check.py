"""Full-size text path on a GPU: prefill logits vs transformers 5.24 (bf16 cosine), decode graph
replay vs eager, and decode step times.

    python ci/text_parity_check.py [--model DIR] [--device cuda] [--out results.json]

Without --model a random full-size PaddleOCR-VL (the 0.9B config: 27-layer vision, 18-layer
ERNIE, vocab 103424, untied head as released) is written with transformers' save_pretrained
to a temporary dir first. Prints one line per check and writes a JSON with the numbers; exits 1
when a check fails (cosine < 0.999, replay != eager).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdeploy_ext.engine.step import SeqStep, StepBatch   # noqa: E402
from fastdeploy_ext.plan import PlanRequest                 # noqa: E402
from fastdeploy_ext.runner import ImageBatch, create_runner  # noqa: E402


def write_random_model(path: Path, device: str, tiny: bool, seed: int = 0) -> Path:
    """save_pretrained of a random PaddleOCR-VL (full size, untied head as released; or the tiny
    test config) plus the released chat template. Prompts are built from ids directly, so the
    built-in byte tokenizer stands in for the tokenizer."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration
    from fastdeploy_ext.models.paddleocr_vl.tokenizer import DEFAULT_CHAT_TEMPLATE
    torch.manual_seed(seed)
    if tiny:
        from fastdeploy_ext.conformance.tiny_text_model import hf_config
        cfg = hf_config(tied=False)
    else:
        cfg = PaddleOCRVLConfig(tie_word_embeddings=False)
        cfg.text_config.tie_word_embeddings = False
    with torch.device(device):
        model = PaddleOCRVLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    (path / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def prompt_for(runner, grid) -> tuple[list[int], torch.Tensor, int]:
    from fastdeploy_ext.models.paddleocr_vl.prompt import rope_index
    cfg = runner.cfg
    # bos "User: " <start> image tokens <end> "OCR:\nAssistant: " with ids inside the vocab
    v = cfg.text.vocab_size
    text = [cfg.bos_token_id] + [(1000 + i) % v for i in range(6)]
    img = [cfg.image_token_id] * (grid[1] * grid[2] // 4)
    tail = [(2000 + i) % v for i in range(12)]
    ids = text + [cfg.vision_start_token_id] + img + [cfg.vision_end_token_id] + tail
    pos, delta, _ = rope_index(ids, cfg.image_token_id, [grid], cfg.vision.spatial_merge_size)
    return ids, pos, delta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--image-hw", default="448,896", help="image height,width in pixels (multiples of 28)")
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true", help="the tiny test config (a CPU smoke run of this script)")
    args = ap.parse_args()
    res: dict = {}
    ok = True
    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        t0 = time.perf_counter()
        model_dir = write_random_model(Path(tmp.name) / "m", args.device, args.tiny)
        res["random_model_write_s"] = round(time.perf_counter() - t0, 1)

    from fastdeploy_ext.runner import available_backends, register_backend
    if args.device not in available_backends():     # run from a source tree that is not installed
        import importlib
        name = {"cpu": "cpu_amx"}.get(args.device, args.device)
        cls_name = {"cuda": "CudaRunner", "metax": "MetaxRunner", "cpu_amx": "CpuAmxRunner", "cpu": "CpuRunner"}
        register_backend(args.device, getattr(importlib.import_module(f"backends.{name}"), cls_name[args.device]))
        print(f"note: backend {args.device} registered from the source tree (package not installed)")
    runner = create_runner(PlanRequest(device=args.device, dtype="bfloat16"))
    if args.model is None:   # the random dir has no tokenizer: prompts are ids, the byte tokenizer stands in
        from fastdeploy_ext.models.paddleocr_vl import tokenizer as tk
        tk.load_tokenizer = lambda d, cfg: tk.ByteTokenizer(tk.builtin_special_tokens(cfg),
                                                            byte_base=3 if cfg.image_token_id > 258 else 16)
    runner.load_model(str(model_dir), with_text=True)
    res["plan"] = {k: str(d.value) for k, d in runner.plan.decisions().items()}
    h, w = (int(x) for x in args.image_hw.split(","))
    grid = (1, h // 14, w // 14)
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(grid[1] * grid[2], 3, 14, 14, generator=g) * 2 - 1
    ids, pos, delta = prompt_for(runner, grid)
    n = len(ids)

    # ---- ours: vision + one prefill, logits at every position
    feats = runner.encode_images(ImageBatch(pixels, [grid]))[0]
    text = runner.text
    text.init_kv_cache((n + text.block_size - 1) // text.block_size + 8)
    inp = text.build_inputs(StepBatch(True, [SeqStep(0, ids, 0, list(range((n + text.block_size - 1) // text.block_size)),
                                                     pos, delta, feats)]))
    inp.logits_index = torch.arange(n, device=runner.device)
    with torch.no_grad():
        ours = text.forward(inp)

    # ---- transformers 5.24 bf16
    from transformers import PaddleOCRVLForConditionalGeneration
    ref = PaddleOCRVLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(args.device).eval()
    t_ids = torch.tensor([ids], device=args.device)
    with torch.no_grad():
        want = ref(input_ids=t_ids, pixel_values=pixels.to(args.device, torch.bfloat16),
                   image_grid_thw=torch.tensor([list(grid)], device=args.device),
                   mm_token_type_ids=(t_ids == runner.cfg.image_token_id).int()).logits[0].float()
    cos = torch.nn.functional.cosine_similarity(ours, want, dim=-1)
    flat = torch.nn.functional.cosine_similarity(ours.flatten(), want.flatten(), dim=0).item()
    res["prefill"] = {"tokens": n, "image_tokens": grid[1] * grid[2] // 4, "cosine_all": flat,
                      "cosine_min_row": cos.min().item(), "cosine_mean_row": cos.mean().item(),
                      "argmax_agree": (ours.argmax(-1) == want.argmax(-1)).float().mean().item(),
                      "max_abs_err": (ours - want).abs().max().item()}
    good = flat >= 0.999 and cos.min().item() >= 0.99
    ok &= good
    print(f"prefill logits vs transformers bf16: cosine {flat:.5f} (min row {cos.min().item():.5f}), "
          f"argmax agree {res['prefill']['argmax_agree']:.3f} -> {'OK' if good else 'FAIL'}")
    del ref
    if runner.device.type != "cuda":
        print(json.dumps(res))
        return 0 if ok else 1
    torch.cuda.empty_cache()

    # ---- decode graphs: replay vs eager, step times at batch 1 and 64 with ~3200 cached tokens
    text.free_kv_cache()
    ctx_len, max_len = 3200, 4096
    bs = text.block_size
    blocks_per = max_len // bs
    for batch in (1, 64):
        text.init_kv_cache(batch * blocks_per)
        text.kv.k.normal_(0, 1)
        text.kv.v.normal_(0, 1)
        tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(batch)]
        step = StepBatch(False, [SeqStep(i, [5 + i], ctx_len, tables[i], None, -30) for i in range(batch)])
        text.graphs = None
        eager = text.execute(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            text.execute(step)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / 20 * 1e3
        rep = runner.capture_decode_graphs(batch, max_len)
        replay = text.execute(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            text.execute(step)
        torch.cuda.synchronize()
        graph_ms = (time.perf_counter() - t0) / 50 * 1e3
        err = (replay - eager).abs().max().item() / max(eager.abs().max().item(), 1e-6)
        agree = (replay.argmax(-1) == eager.argmax(-1)).float().mean().item()
        res[f"decode_b{batch}"] = {"eager_ms": round(eager_ms, 3), "graph_ms": round(graph_ms, 3),
                                   "graphs_captured": rep.captured, "capture_s": round(rep.capture_seconds, 2),
                                   "replay_vs_eager_rel_err": err, "argmax_agree": agree,
                                   "tokens_per_s_graph": round(batch / graph_ms * 1e3, 1)}
        good = err <= 2e-2 and agree == 1.0
        ok &= good
        print(f"decode batch {batch} ctx {ctx_len}: eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms/step "
              f"({batch / graph_ms * 1e3:.0f} tok/s), replay vs eager rel err {err:.2e} -> {'OK' if good else 'FAIL'}")
        text.free_kv_cache()
    res["ok"] = bool(ok)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
