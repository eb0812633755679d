"""The reference side of `bench serve`: transformers' `generate` behind the same HTTP request
stream as our server (a minimal OpenAI-style `/v1/chat/completions`, streaming only).

Requests that arrive together are batched as transformers can (static batches of up to
``--max-batch``, left-padded; a batch runs to its longest request), the way a simple
transformers deployment serves. Prompt ids and pixels come from the same prompt builder and
image processor as our engine (our processor equals transformers' PIL one bit for bit), so both
sides see identical inputs. Run: ``python -m fastdeploy_ext.bench.serve_reference --model DIR``."""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import threading
import time

import torch

log = logging.getLogger("fastdeploy_ext.bench.serve_reference")


class _RowStreamer:
    """transformers streamer: the first put() is the prompt, then one token per row per step."""

    def __init__(self, on_step):
        self.on_step, self.seen_prompt = on_step, False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.on_step(value.reshape(-1).tolist())

    def end(self):
        pass


class Reference:
    def __init__(self, model_dir: str, device: str, dtype: str, max_batch: int):
        from transformers import PaddleOCRVLForConditionalGeneration

        from ..models.registry import detect_family
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.device = torch.device(device)
        self.model = PaddleOCRVLForConditionalGeneration.from_pretrained(model_dir, dtype=dt).to(self.device).eval()
        # our side's family hooks read the same dir: same prompt ids and pixels on both servers
        self.family = detect_family(model_dir).family
        self.cfg = self.family.read_config(model_dir)
        self.tokenizer, self.template = self.family.load_tokenizer(model_dir, self.cfg)
        self.processor = self.family.image_processor(model_dir)
        self.max_batch = max_batch

    def prepare(self, body: dict):
        messages, images = [], []
        for m in body["messages"]:
            content = m["content"]
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p["type"] == "image_url":
                        url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                        images.append(self.processor.preprocess(base64.b64decode(url.partition(",")[2])))
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": p["text"]})
                content = parts
            messages.append({"role": m["role"], "content": content})
        p = self.family.build_prompt(self.tokenizer, self.template, self.cfg, messages=messages,
                                     image_grids=[tuple(im.grid_thw) for im in images])
        return list(p.token_ids), images

    def generate(self, batch: list, on_step) -> None:
        """batch: [(prompt ids, images, max_tokens)]; left padding; greedy; exactly max_tokens."""
        n = max(len(ids) for ids, _, _ in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        mask = torch.zeros(len(batch), n, dtype=torch.long)
        for i, (p, _, _) in enumerate(batch):
            ids[i, n - len(p):] = torch.tensor(p)
            mask[i, n - len(p):] = 1
        ims = [im for _, imgs, _ in batch for im in imgs]
        kw = {}
        if ims:
            kw = dict(pixel_values=torch.cat([im.pixel_values for im in ims]).to(self.device, self.model.dtype),
                      image_grid_thw=torch.tensor([im.grid_thw for im in ims]).to(self.device),
                      mm_token_type_ids=(ids == self.model.config.image_token_id).int().to(self.device))
        tokens = max(t for _, _, t in batch)
        with torch.inference_mode():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw,
                                max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                streamer=_RowStreamer(on_step))


def build_app(ref: Reference):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    waiting: asyncio.Queue = asyncio.Queue()
    lock = threading.Lock()

    async def batcher():
        loop = asyncio.get_running_loop()
        while True:
            batch = [await waiting.get()]
            while len(batch) < ref.max_batch and not waiting.empty():
                batch.append(waiting.get_nowait())
            queues = [q for *_, q in batch]
            limits = [t for _, _, t, _ in batch]
            counts = [0] * len(batch)

            def on_step(row_tokens):
                for i, tok in enumerate(row_tokens):
                    if counts[i] < limits[i]:
                        counts[i] += 1
                        loop.call_soon_threadsafe(queues[i].put_nowait, tok)

            def run():
                with lock:
                    ref.generate([(p, im, t) for p, im, t, _ in batch], on_step)
            try:
                await loop.run_in_executor(None, run)
            finally:
                for q in queues:
                    q.put_nowait(None)

    async def chat(request):
        body = await request.json()
        ids, images = await asyncio.get_running_loop().run_in_executor(None, ref.prepare, body)
        q: asyncio.Queue = asyncio.Queue()
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        await waiting.put((ids, images, max_tokens, q))

        continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        async def events():
            n = 0
            while (tok := await q.get()) is not None:
                n += 1
                chunk = {"choices": [{"index": 0, "delta": {"content": ref.tokenizer.decode([tok])}}]}
                if continuous:          # vLLM's option: each chunk carries the running token count
                    chunk["usage"] = usage(n)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage(n)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher())
        yield
        task.cancel()

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)],
                     lifespan=lifespan)


def main(argv=None) -> int:
    import uvicorn
    p = argparse.ArgumentParser(prog="python -m fastdeploy_ext.bench.serve_reference")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[reference] %(levelname)s %(message)s")
    t0 = time.perf_counter()
    ref = Reference(ns.model, ns.device, ns.dtype, ns.max_batch)
    log.info("transformers reference loaded in %.1fs (%s, %s)", time.perf_counter() - t0, ns.device, ns.dtype)
    uvicorn.run(build_app(ref), host="127.0.0.1", port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
