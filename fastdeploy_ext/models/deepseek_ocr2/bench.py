"""`bench vision` and `bench generate` on DeepSeek-OCR-2: ours against transformers'
DeepseekOcr2ForConditionalGeneration in one process on one device, same pixels (our processor
equals transformers' PIL one bitwise) and same prompt ids. Same weights with ``--model DIR`` (a
dir transformers loads: what ``save_pretrained`` writes); with ``--load-format dummy`` transformers
builds the released config with its own random init (speed compares, outputs do not).

Vision workloads (images of random pixels, at the shapes of the transformers H200 figures in
docs/DEEPSEEK_OCR2.md):
``nocrop`` one 600x500 page (a global view: 257 rows), ``page6`` one 1000x1600 page (6 crops +
the global view: 1121 rows), ``nocrop16`` 16 no-crop pages, ``page6x16`` 16 six-crop pages.
Both sides are timed from pixels already on the device: ours from the uploaded batch
(``encode_uploaded``: tower, projector), the reference from its processor's tensors
(``get_image_features``); our upload of the batch's bytes from pinned memory is timed apart and
printed beside. Nothing here asserts a time."""
from __future__ import annotations

import gc
import io
import json
import time
from dataclasses import replace
from functools import partial

import torch

VISION_WORKLOADS: dict[str, list[tuple[int, int]]] = {      # (width, height) per image
    "nocrop": [(600, 500)],
    "page6": [(1000, 1600)],
    "nocrop16": [(600, 500)] * 16,
    "page6x16": [(1000, 1600)] * 16,
}
DEFAULT_VISION_WORKLOADS = ("nocrop", "page6", "nocrop16", "page6x16")
# the plan variants this family has: SAM's qkv layout x the dual-path encoder graphs (off, the
# paths one after the other, the paths side by side: ``encoder_overlap_paths``); the graph
# variants need a row that captures encoder graphs (CUDA)
VISION_VARIANTS = {"strided/host/eager": ("strided", False, False), "dense/host/eager": ("dense", False, False),
                   "strided/host/graph": ("strided", True, False), "dense/host/graph": ("dense", True, False),
                   "strided/host/graph+overlap": ("strided", True, True),
                   "dense/host/graph+overlap": ("dense", True, True)}


def random_image(w: int, h: int, seed: int):
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


def reference_model(model_dir: str | None, device: torch.device, dtype: torch.dtype):
    """transformers' model: the dir's weights, or (dummy) its random init of our released config."""
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration

    from .config import DeepseekOCR2Config
    if model_dir is None:
        d = DeepseekOCR2Config().to_transformers_json()
        with torch.device(device):
            cfg = DeepseekOcr2Config(**{k: v for k, v in d.items() if k != "model_type"})
            return DeepseekOcr2ForConditionalGeneration(cfg).to(dtype).eval()
    return DeepseekOcr2ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def reference_pixels(images, device, dtype) -> dict:
    """transformers' PIL processor's tensors for ``images`` (those get_image_features / generate take)."""
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import DeepseekOcr2ImageProcessorPil
    r = DeepseekOcr2ImageProcessorPil()(images=images, return_tensors="pt")
    out = {"pixel_values": r["pixel_values"].to(device, dtype), "num_local_patches": r["num_local_patches"]}
    if r.get("pixel_values_local") is not None:
        out["pixel_values_local"] = r["pixel_values_local"].to(device, dtype)
    return out


def run_vision_bench(source, base, opts) -> int:
    """bench vision for this family (fastdeploy_ext/bench/vision.py hands over here)."""
    from ...bench import BenchError
    from ...bench.timing import Timer, cosine, peak_gib, reset_peak
    from ...bench.vision import profile_kernels
    from ...plan import PlanError
    from ...runner import ImageBatch, choose_device
    workloads = DEFAULT_VISION_WORKLOADS if opts.workloads == type(opts).workloads else opts.workloads
    unknown = [w for w in workloads if w not in VISION_WORKLOADS]
    if unknown:
        raise BenchError(f"unknown deepseek_ocr2 workloads {unknown}; known: {', '.join(VISION_WORKLOADS)}")
    names = list(VISION_VARIANTS) if opts.variants == "all" else [n.strip() for n in opts.variants.split(",")]
    bad = [n for n in names if n not in VISION_VARIANTS]
    if bad:
        raise BenchError(f"deepseek_ocr2 has the variants {', '.join(VISION_VARIANTS)} only (the fused passes "
                         f"follow the plan, not a variant); got {bad}")
    cls, probe, _ = choose_device(base.device)
    images = {w: [random_image(x, y, 100 + i) for i, (x, y) in enumerate(VISION_WORKLOADS[w])] for w in workloads}
    results, ref_out, ref_ms, timer = [], {}, {}, None
    for name in names:
        qkv, graphs, overlap = VISION_VARIANTS[name]
        try:
            runner = cls.create(replace(base, qkv_layout=qkv if base.qkv_layout == "auto" else base.qkv_layout,
                                        grid_thw="host",
                                        graph_config=replace(base.graph_config, use_encoder_cudagraph=graphs,
                                                             encoder_overlap_paths=overlap)),
                                probe=probe)
        except PlanError as e:
            print(f"variant {name}: skipped on this device: {e}")
            continue
        source.load_into(runner)
        report = runner.capture_graphs()
        api, plan = runner.device_api, runner.plan
        timer = timer or Timer(api, opts.warmup, opts.iters)
        print(f"\n== {name}: qkv={plan.qkv_layout.value} window={plan.relpos_window_attention.value} "
              f"global={plan.relpos_global_attention.value} encoder={plan.prefix_causal_attention.value} "
              f"dtype={runner.dtype} row={plan.row}{' [EMULATED]' if plan.emulated else ''} graphs="
              + (f"{report.captured} ({runner.graphs.describe()}; {report.capture_seconds:.1f}s, "
                 f"{report.graph_memory_bytes / 2**20:.0f} MiB)" if report.captured else f"off ({report.reason})"))
        if opts.reference and not ref_ms:
            ref = reference_model(source.model_dir if source.load_format != "dummy" else None, runner.device,
                                  runner.dtype)
            print("== transformers reference (DeepseekOcr2Model.get_image_features)"
                  + ("" if source.load_format != "dummy" else ": its own random init, outputs do not compare"))
            for w in workloads:
                px = reference_pixels(images[w], runner.device, runner.dtype)

                def call(px=px):
                    with torch.inference_mode():
                        return ref.model.get_image_features(**px).pooler_output
                reset_peak(api)
                ref_ms[w] = timer(call)
                peak = peak_gib(api)
                ref_out[w] = torch.cat(list(call())).float() if source.load_format != "dummy" else None
                results.append({"workload": w, "variant": "transformers", "ms": ref_ms[w], "peak_gib": peak,
                                "speedup_vs_ref": 1.0})
                print(f"  {w:<10} {ref_ms[w]:9.2f} ms")
            del ref
            gc.collect()
        proc = runner.family.image_processor(source.model_dir if source.load_format != "dummy" else None)
        for w in workloads:
            batch = ImageBatch.from_images([proc.preprocess(im, f"{w}{i}") for i, im in enumerate(images[w])])
            pv, grids = runner.check_batch(batch)
            # timed from pixels on the device, as the reference's are; the upload (the bytes from
            # pinned host memory) is timed apart
            upload_ms = timer(partial(runner.upload_pixels, pv))
            encode = partial(runner.encode_uploaded, runner.upload_pixels(pv), grids)
            encode()
            reset_peak(api)
            ms = timer(encode)
            peak = peak_gib(api)
            out = torch.cat(encode()).float()
            cos = cosine(out, ref_out[w]) if ref_out.get(w) is not None else None
            row = {"workload": w, "variant": name, "ms": ms, "upload_ms": upload_ms, "peak_gib": peak,
                   "cosine_vs_ref": cos, "speedup_vs_ref": ref_ms[w] / ms if w in ref_ms else None,
                   "rows": out.shape[0], "ms_per_image": ms / len(images[w]),
                   "device": plan.device, "row": plan.row, "emulated": plan.emulated}
            if runner.graphs is not None:       # per path: replays per budget, views run eager
                row["graph_stats"] = {n: {"per_budget": dict(st.per_budget), "eager_views": st.eager_views}
                                      for n, st in runner.graphs.stats.items()}
            results.append(row)
            sp = f"x{row['speedup_vs_ref']:5.2f} vs ref" if row["speedup_vs_ref"] else "(no reference)"
            print(f"  {w:<10} {ms:9.2f} ms  {sp}  {ms / len(images[w]):7.2f} ms/page  (+ upload {upload_ms:.2f} ms)  "
                  f"rows {out.shape[0]}" + (f"  cos {cos:.6f}" if cos is not None else ""))
            if opts.profile:        # --profile TOP: the stage breakdown and the top kernels of one call
                row["stages"] = vision_stages(runner, batch, timer)
                print_stages(row["stages"])
                row["profile"] = profile_kernels(encode, api, opts.profile)
        # every reference to the runner goes (the bound `encode` too) before the next variant loads
        del runner, encode
        gc.collect()
        api.empty_cache()
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"device": str(probe.summary()), "family": "deepseek_ocr2", "results": results}, f, indent=1)
    return 0


def vision_stages(runner, batch, timer) -> list[dict]:
    """Where one eager pass of ``batch`` goes, stage by stage, per path (global views, crops):
    SAM's patch embedding, its windowed and its global blocks (summed per kind), the neck, the
    Qwen2 encoder and the projector, each timed alone on the input the stages before it made
    (the plan's backends, ``runner.execution``). The stages add up to about the eager pass."""
    from . import vision as V
    model, ex = runner.model, runner.execution
    pixels = batch.pixel_values.to(runner.device)
    meta = runner.meta_builder.build_host(batch.grid_thw)
    glob, crops = model.split_views(pixels, meta)
    rows = []
    sam = model.sam
    with torch.inference_mode():
        for path, parts, is_global in (("global", glob, True), ("local", crops, False)):
            if not parts:
                continue
            n, patches = len(parts), torch.cat(parts)
            side = int(round((patches.shape[0] // n) ** 0.5))
            stage = {}

            def embed():
                return sam.patch_embed(patches).view(n, side, side, -1) + sam.positions(side)
            stage["sam patch embed + positions"] = (timer(embed), 1)
            x = embed()
            if ex.fused_layers and V.passes_usable(x.device):
                # the fused passes run the blocks as one chain (each pass ends one block and starts
                # the next): one stage, the residual stream's copy included (it is updated in place)
                flat = x.view(-1, x.shape[-1])
                stage["sam blocks (fused passes)"] = (
                    timer(lambda: sam.blocks_fused(flat.clone(), n, side, ex)), len(sam.blocks))
                x = sam.blocks_fused(flat.clone(), n, side, ex).view(x.shape)
            for blk in () if "sam blocks (fused passes)" in stage else sam.blocks:
                name = "sam windowed blocks" if blk.window else "sam global blocks"
                ms = timer(partial(blk, x, ex))
                total, count = stage.get(name, (0.0, 0))
                stage[name] = (total + ms, count + 1)
                x = blk(x, ex)

            def neck(x=x):
                return sam.net_3(sam.net_2(sam.neck(x.permute(0, 3, 1, 2)))).flatten(2).transpose(1, 2)
            stage["sam neck + downsample"] = (timer(neck), 1)
            visual = neck()
            q = model.query_1024.weight if is_global else model.query_768.weight
            stage["qwen2 encoder"] = (timer(partial(model.encoder, visual, q, ex)), len(model.encoder.layers))
            enc = model.encoder(visual, q, ex)
            stage["projector"] = (timer(partial(model.projector, enc)), 1)
            rows += [{"path": path, "views": n, "stage": k, "ms": ms, "count": c} for k, (ms, c) in stage.items()]
    return rows


def print_stages(rows: list[dict]) -> None:
    total = sum(r["ms"] for r in rows) or 1.0
    print(f"    stages (eager, each timed alone; sum {total:.2f} ms):")
    for r in rows:
        print(f"      {r['path']:<6} x{r['views']:<3} {r['stage']:<28} {r['ms']:9.3f} ms {r['ms'] / total * 100:5.1f}%"
              + (f"  ({r['count']} layers)" if r["count"] > 1 else ""))


class TransformersReference:
    """bench generate's reference for this family: transformers' generate per request (one
    image's crops per prompt), the prompt ids ours (equal to transformers' processor's, tested)
    and transformers' pixels."""

    def __init__(self, model_dir: str | None, device: torch.device, dtype: torch.dtype, engine):
        from ...device_api import device_api_for
        self.model = reference_model(model_dir, device, dtype)
        self.same_weights = model_dir is not None
        self.device, self.dtype, self.engine = device, dtype, engine
        self.api = device_api_for(device)

    def generate(self, images: list[bytes], prompt: str, tokens: int) -> tuple[float, list[list[int]]]:
        from PIL import Image
        self.api.synchronize()
        t0 = time.perf_counter()
        out = []
        for png in images:
            ids = self.engine.input_processor.process({"prompt": prompt, "images": [png]}).prompt_token_ids
            px = reference_pixels([Image.open(io.BytesIO(png)).convert("RGB")], self.device, self.dtype)
            input_ids = torch.tensor([ids], device=self.device)
            with torch.inference_mode():
                g = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **px,
                                        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            out.append(g[0, len(ids):].tolist())
        self.api.synchronize()
        return time.perf_counter() - t0, out
