"""Regenerate the conformance suite's reference data (package data under reference_data/).

    python -m fastdeploy_ext.conformance.make_references            # everything
    python -m fastdeploy_ext.conformance.make_references --only encoder_features
    python -m fastdeploy_ext.conformance.make_references --out /tmp/refs   # elsewhere, to compare

Needs transformers 5.24 (the numerical reference) for the checkpoint and the expected outputs.
Producers run in order; each writes its entry and the manifest records the files' sha256, the
versions that produced them and the entries they were computed from. Entries not regenerated
keep their manifest records, so adding an entry (e.g. greedy token ids for generation tests:
append a Producer) leaves the others' bytes untouched.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .references import REFERENCE_ROOT, Manifest, MissingReference, ReferenceEntry, sha256_file

ENCODER_FEATURES_DTYPE = torch.float32


@dataclass(frozen=True)
class Producer:
    name: str
    kind: str
    path: str
    description: str
    inputs: tuple[str, ...]
    make: Callable[[Path, dict[str, Path]], None]   # (destination, input name -> path)


def pixels_sha256(pixel_values: torch.Tensor) -> str:
    """Identity of the encoder's input: the expected features hold only for these pixels."""
    return hashlib.sha256(pixel_values.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def processed_batch(model_dir: Path, image_paths: list[Path]):
    """The batch the suite encodes: our processor on the shipped images with the checkpoint's
    preprocessor config (the sizes need no resize, so transformers' processor agrees)."""
    from ..models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
    from ..runner import ImageBatch
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(model_dir))
    return ImageBatch.from_images([proc.preprocess(p) for p in image_paths])


def _make_tiny_torch(dst: Path, inputs: dict[str, Path]) -> None:
    from .tiny_model import write_torch_model
    write_torch_model(dst, dtype=torch.bfloat16)


def _make_tiny_paddle(dst: Path, inputs: dict[str, Path]) -> None:
    from .tiny_model import write_paddle_twin
    write_paddle_twin(inputs["tiny_torch"], dst)


def _make_tiny_vl(dst: Path, inputs: dict[str, Path]) -> None:
    from .tiny_text_model import write_tiny_vl_model
    write_tiny_vl_model(dst)


def _make_images(dst: Path, inputs: dict[str, Path]) -> None:
    from .tiny_model import write_images
    write_images(dst)


def _make_encoder_features(dst: Path, inputs: dict[str, Path]) -> None:
    from safetensors.torch import save_file

    from .tiny_model import reference_image_features
    images = sorted(inputs["images"].glob("*.png"))
    batch = processed_batch(inputs["tiny_torch"], images)
    feats = reference_image_features(inputs["tiny_torch"], batch.pixel_values, batch.grid_thw,
                                     dtype=ENCODER_FEATURES_DTYPE)
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"image{i}": f.contiguous() for i, f in enumerate(feats)}, str(dst),
              metadata={"grid_thw": repr([tuple(g) for g in batch.grid_thw]),
                        "images": repr([p.name for p in images]),
                        "pixel_values_sha256": pixels_sha256(batch.pixel_values),
                        "dtype": str(ENCODER_FEATURES_DTYPE)})


GENERATE_PROMPT, GENERATE_MAX_TOKENS = "OCR:", 8


def reference_greedy_ids(model_dir: Path, image_paths: list[Path], prompt: str, max_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one request per image, fp32 on the CPU, for the prompt
    our engine builds (same chat template, tokenizer and pixels)."""
    from .tiny_text_model import load_reference
    from ..engine.input_processor import FamilyPromptBuilder, InputLimits, InputProcessor
    from ..models.paddleocr_vl.config import PaddleOCRVLConfig
    from ..models.registry import get_family
    from ..models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
    from ..models.paddleocr_vl.tokenizer import load_chat_template, load_tokenizer

    class _Host:
        cfg = PaddleOCRVLConfig.from_model_dir(model_dir)
    builder = FamilyPromptBuilder(get_family("paddleocr_vl"), _Host.cfg, load_tokenizer(model_dir, _Host.cfg),
                                  load_chat_template(model_dir))
    proc = InputProcessor(builder, ImageProcessor(PreprocessorConfig.from_model_dir(model_dir)),
                          InputLimits(1, 1 << 30, 1 << 30))
    model = load_reference(model_dir)
    out = []
    for path in image_paths:
        pp = proc.process({"prompt": prompt, "images": [str(path)]})
        ids = torch.tensor([pp.prompt_token_ids])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 pixel_values=torch.cat([it.encoder_inputs for it in pp.items]),
                                 image_grid_thw=torch.tensor([it.grid for it in pp.items]),
                                 mm_token_type_ids=(ids == _Host.cfg.image_token_id).int(),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _make_generate_greedy(dst: Path, inputs: dict[str, Path]) -> None:
    import json
    images = sorted(inputs["images"].glob("*.png"))
    ids = reference_greedy_ids(inputs["tiny_vl"], images, GENERATE_PROMPT, GENERATE_MAX_TOKENS)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps({"prompt": GENERATE_PROMPT, "max_tokens": GENERATE_MAX_TOKENS,
                               "images": [p.name for p in images], "token_ids": ids}, indent=1))


TEXT_PROMPT = "OCR:"
TEXT_CONTINUATION = (17, 101, 230, 45, 9, 288)     # teacher-forced decode tokens after the prompt


def text_prompt(model_dir: Path, image: Path):
    """(prompt, processed image): our chat template + tokenizer + placeholder expansion for one
    shipped image with the task prompt "OCR:"."""
    from ..models.paddleocr_vl.config import PaddleOCRVLConfig
    from ..models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
    from ..models.paddleocr_vl.prompt import build_prompt
    from ..models.paddleocr_vl.tokenizer import load_chat_template, load_tokenizer
    cfg = PaddleOCRVLConfig.from_model_dir(model_dir)
    im = ImageProcessor(PreprocessorConfig.from_model_dir(model_dir)).preprocess(image)
    p = build_prompt(load_tokenizer(model_dir, cfg), load_chat_template(model_dir), cfg, prompt=TEXT_PROMPT,
                     image_grids=[im.grid_thw])
    return p, im


def _make_text_logits(dst: Path, inputs: dict[str, Path]) -> None:
    from safetensors.torch import save_file

    from .tiny_text_model import load_reference, reference_logits
    image = sorted(inputs["images"].glob("*.png"))[0]
    p, im = text_prompt(inputs["tiny_vl"], image)
    ids = p.token_ids + list(TEXT_CONTINUATION)
    logits = reference_logits(load_reference(inputs["tiny_vl"]), ids, im.pixel_values, [list(im.grid_thw)])
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = len(p.token_ids)
    save_file({"logits": logits[n - 1:].contiguous(), "prompt_token_ids": torch.tensor(p.token_ids),
               "continuation": torch.tensor(TEXT_CONTINUATION)}, str(dst),
              metadata={"image": image.name, "grid_thw": repr(tuple(im.grid_thw)), "prompt": TEXT_PROMPT,
                        "pixel_values_sha256": pixels_sha256(im.pixel_values), "dtype": "torch.float32"})


DETECTOR_OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")


def _make_tiny_detector(dst: Path, inputs: dict[str, Path]) -> None:
    from ..models.pp_doclayout_v3.tiny import write_model
    write_model(dst)


def reference_detector_outputs(model_dir: Path, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' PPDocLayoutV3ForObjectDetection outputs for ``pixels``, fp32 on the CPU."""
    from transformers import PPDocLayoutV3ForObjectDetection
    model = PPDocLayoutV3ForObjectDetection.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        out = model(pixel_values=pixels)
    return {k: getattr(out, k).float().contiguous() for k in DETECTOR_OUTPUTS}


def _make_detector_outputs(dst: Path, inputs: dict[str, Path]) -> None:
    from safetensors.torch import save_file

    from ..models.pp_doclayout_v3.tiny import PAGE_SIZES, page_pixels
    pixels, sizes = page_pixels(inputs["tiny_detector"])
    assert sizes == list(PAGE_SIZES)
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(reference_detector_outputs(inputs["tiny_detector"], pixels) | {"pixel_values": pixels}, str(dst),
              metadata={"pixel_values_sha256": pixels_sha256(pixels), "page_sizes": repr(sizes),
                        "dtype": "torch.float32"})


def reference_detections(model_dir: Path, outputs: dict[str, torch.Tensor], sizes, threshold: float) -> list:
    """transformers' post_process_object_detection on the reference outputs: per page its
    kept (label id, score, box) in the order it returns them (reading order), as JSON."""
    from types import SimpleNamespace

    from transformers import PPDocLayoutV3ImageProcessor
    proc = PPDocLayoutV3ImageProcessor.from_pretrained(str(model_dir))
    res = proc.post_process_object_detection(SimpleNamespace(**outputs), threshold=threshold, target_sizes=sizes)
    return [{"labels": r["labels"].tolist(), "scores": r["scores"].tolist(), "boxes": r["boxes"].tolist()}
            for r in res]


def detector_golden(outputs: dict[str, torch.Tensor], sizes, threshold: float) -> list[list[dict]]:
    """Post-processed reference outputs (ours: sigmoid, top-k, threshold, corners in page pixels,
    reading order; the same computation as transformers' post_process_object_detection): per
    page, per detection its label, label id, score, bbox and reading-order rank."""
    from ..models.pp_doclayout_v3.config import RELEASED_LABELS
    from ..models.pp_doclayout_v3.postprocess import detections
    pages = detections(outputs["logits"], outputs["pred_boxes"], outputs["order_logits"], sizes, RELEASED_LABELS,
                       threshold=threshold)
    return [[{"label": d.label, "label_id": d.label_id, "score": d.score, "bbox": list(d.bbox), "order": d.order}
             for d in page] for page in pages]


def read_tensors_with_metadata(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _make_detector_detections(dst: Path, inputs: dict[str, Path]) -> None:
    import ast
    import json

    from ..models.pp_doclayout_v3.tiny import THRESHOLD
    t, info = read_tensors_with_metadata(inputs["detector_outputs"])
    sizes = [tuple(s) for s in ast.literal_eval(info["page_sizes"])]
    body = {"threshold": THRESHOLD, "page_sizes": [list(s) for s in sizes],
            "pages": detector_golden(t, sizes, THRESHOLD)}
    try:            # transformers' own post-processing, where its image processor loads (torchvision)
        body["transformers"] = reference_detections(inputs["tiny_detector"], {k: t[k] for k in DETECTOR_OUTPUTS},
                                                    sizes, THRESHOLD)
    except Exception as e:      # noqa: BLE001 - recorded: which reference the goldens were checked against
        body["transformers_unavailable"] = f"{type(e).__name__}: {e}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(body, indent=1))


PRODUCERS: tuple[Producer, ...] = (
    Producer("tiny_torch", "model_dir", "tiny_torch",
             "random tiny PaddleOCR-VL (vision 2x72 heads, 2 layers; text 1 layer), save_pretrained, bf16 weights",
             (), _make_tiny_torch),
    Producer("tiny_paddle", "model_dir", "tiny_paddle",
             "the same weights in Paddle layout (Linear weights [in, out]), 2 shards, size-form preprocessor config",
             ("tiny_torch",), _make_tiny_paddle),
    Producer("images", "files", "images", "random RGB PNGs whose sizes need no resize", (), _make_images),
    Producer("encoder_features", "tensors", "expected/encoder_features.safetensors",
             "transformers get_image_features(...).pooler_output, fp32 on the CPU, one tensor per image, "
             "for our processor's pixels of `images`",
             ("tiny_torch", "images"), _make_encoder_features),
    Producer("tiny_vl", "model_dir", "tiny_vl",
             "random tiny PaddleOCR-VL with an ERNIE decoder (2 layers, GQA 4/2, vocab 320), tokenizer.json and the "
             "released chat template: the generation tests' model", (), _make_tiny_vl),
    Producer("generate_greedy", "json", "expected/generate_greedy.json",
             "transformers generate, greedy, fp32 on the CPU: 8 new tokens (ignore eos) per shipped image, "
             "prompt 'OCR:' in the tiny_vl chat template, one request per image",
             ("tiny_vl", "images"), _make_generate_greedy),
    Producer("text_logits", "tensors", "expected/text_logits.safetensors",
             "transformers fp32 CPU logits of tiny_vl for the first image with the prompt 'OCR:' (our prompt "
             "ids) followed by 6 teacher-forced tokens: rows from the last prompt token on",
             ("tiny_vl", "images"), _make_text_logits),
    Producer("tiny_detector", "model_dir", "tiny_detector",
             "random tiny PP-DocLayoutV3 (models/pp_doclayout_v3/tiny.py: HGNetV2 of 4 one-block stages, d_model 32, 2 decoder "
             "layers, 300 queries, 25 classes), save_pretrained, fp32 weights, 128x128 processor", (),
             _make_tiny_detector),
    Producer("detector_outputs", "tensors", "expected/detector_outputs.safetensors",
             "transformers PPDocLayoutV3ForObjectDetection outputs (logits, pred_boxes, order_logits, "
             "enc_outputs_class, enc_outputs_coord_logits), fp32 on the CPU, for our processor's pixels of "
             "the family's tiny.pages() (stored with them)", ("tiny_detector",), _make_detector_outputs),
    Producer("detector_detections", "json", "expected/detector_detections.json",
             "the reference outputs post-processed (sigmoid, top-k, threshold, corners in page pixels, reading "
             "order): per page label, score, bbox, order", ("tiny_detector", "detector_outputs"),
             _make_detector_detections),
)


def _versions() -> dict:
    import transformers
    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def _record(p: Producer, root: Path, inputs: dict[str, Path]) -> ReferenceEntry:
    target = root / p.path
    if p.kind in ("model_dir", "files"):
        files = {str(f.relative_to(target)): sha256_file(f) for f in sorted(target.rglob("*")) if f.is_file()}
    else:
        files = {target.name: sha256_file(target)}
    return ReferenceEntry(p.name, p.kind, p.path, files, p.description, p.inputs, _versions())


def generate(root: Path = REFERENCE_ROOT, only: tuple[str, ...] = ()) -> Manifest:
    """Run the producers (all, or ``only`` those) into ``root`` and rewrite its manifest."""
    known = {p.name for p in PRODUCERS}
    unknown = set(only) - known
    if unknown:
        raise SystemExit(f"unknown reference(s) {sorted(unknown)}; known: {', '.join(p.name for p in PRODUCERS)}")
    root.mkdir(parents=True, exist_ok=True)
    try:
        entries = dict(Manifest.load(root).entries)
    except MissingReference:
        entries = {}
    for p in PRODUCERS:
        if only and p.name not in only:
            continue
        inputs = {}
        for name in p.inputs:
            if name not in entries:
                raise SystemExit(f"{p.name} needs {name}: generate it first (or drop --only)")
            inputs[name] = root / entries[name].path
        target = root / p.path
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        p.make(target, inputs)
        for f in ([target] if target.is_file() else target.rglob("*")):
            f.chmod(0o644)                # safetensors writes 0600; package data must be readable
        entries[p.name] = _record(p, root, inputs)
        print(f"{p.name} -> {target}")
    manifest = Manifest(root, entries)
    manifest.save()
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy_ext.conformance.make_references", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REFERENCE_ROOT, help="directory to write (default: the package's)")
    ap.add_argument("--only", nargs="+", default=(), metavar="NAME", help="regenerate only these entries")
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("make_references needs transformers (pip install -e '.[test]')", file=sys.stderr)
        return 2
    manifest = generate(args.out, tuple(args.only))
    total = sum((manifest.root / e.path / f if e.kind in ("model_dir", "files") else manifest.root / e.path).stat().st_size
                for e in manifest.entries.values() for f in e.files)
    print(f"{len(manifest.entries)} entries, {total / 1024:.0f} KiB, manifest {manifest.root / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
