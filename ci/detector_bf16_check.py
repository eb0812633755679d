"""The layout detector in bf16 at full size (the default PP-DocLayoutV3 config, random weights)
against transformers' model in fp32 with the same (bf16-rounded) weights on the same 800x800
pages. bf16 may reorder the encoder's top-300 selection, which would pair different queries, so
our forward reuses the reference's top-k indices; then the class logits (and boxes) must agree
by cosine >= 0.999, and the encoder's per-position scores before the top-k too.

    python3 ci/detector_bf16_check.py --device cuda [--batch 4] [--json-out FILE]

Exit status 1 when a cosine is below the bar. Runs on the H200 (ci/gpu_leg.sh detect)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BAR = 0.999


@contextlib.contextmanager
def reuse_topk(indices: torch.Tensor, k: int):
    """torch.topk over [B, S] with k queries returns ``indices`` (the reference's selection);
    every other call is the real one."""
    real = torch.topk

    def topk(x, kk, *a, **kw):
        out = real(x, kk, *a, **kw)
        if kk == k and x.ndim == 2 and x.shape[0] == indices.shape[0]:
            return torch.return_types.topk((x.gather(1, indices), indices))
        return out
    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = real


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    fin = torch.isfinite(a) & torch.isfinite(b)
    return torch.nn.functional.cosine_similarity(a[fin], b[fin], dim=0).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    from fastdeploy_ext.bench.detect import make_pages
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import create_runner
    runner = create_runner(PlanRequest(device=args.device, dtype="bfloat16"))
    runner.load_detector(None, load_format="dummy")
    cfg, dev = runner.detector_cfg, runner.device
    ref = runner.detector_family.transformers_reference(None, runner.detector, cfg).to(dev, torch.float32)
    px = make_pages(args.batch, runner.detector_input_size()).to(dev)
    with torch.inference_mode():
        want = ref(pixel_values=px)
        idx = want.enc_outputs_class.max(-1).values.topk(cfg.num_queries, dim=1).indices
        with reuse_topk(idx, cfg.num_queries):
            got = runner.detector(px.to(torch.bfloat16))
    result = {"device": str(dev), "batch": args.batch, "input": list(runner.detector_input_size()),
              "bar": BAR, "cosine": {k: cosine(getattr(got, k), getattr(want, k))
                                     for k in ("logits", "pred_boxes", "enc_outputs_class")}}
    result["pass"] = all(v >= BAR for v in result["cosine"].values())
    print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
