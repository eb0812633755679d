"""The step loop's guards on a real device (the H200 leg; any device works): the sampler's per-row
finite check on CUDA (NaN / inf / all -inf rows fail alone, top_p 0 and temperature 1e-46 are
argmax), then the values that used to kill the step loop sent as requests while 16 streams run
through AsyncLLMEngine on the dummy 0.9B in bf16: the 16 complete, each killer is refused
(InvalidRequest) or greedy, the engine stays healthy with no KV block left.
  usage: python3 ci/engine_fault_check.py [--device cuda] [--json-out F]   (exit 1 if a check fails)"""
import argparse
import asyncio
import json
import sys
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, ".")
from fastdeploy_ext.ops.sampler import SampleRequest, sample
from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.plan import PlanRequest

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--json-out")
opts = ap.parse_args()
res = {}
dev = torch.device(opts.device)
V = 103424
x = torch.randn(8, V, device=dev) * 5
x[1, 5] = float("nan"); x[3, 9] = float("inf"); x[5] = float("-inf")
reqs = [SampleRequest(temperature=0.0), SampleRequest(temperature=0.8),
        SampleRequest(temperature=0.8, generator=torch.Generator(device=dev).manual_seed(1)),
        SampleRequest(temperature=0.7, top_p=0.9, num_logprobs=3),
        SampleRequest(temperature=1.0, top_p=0.0), SampleRequest(temperature=1.0, top_k=2**63 - 1),
        SampleRequest(temperature=1e-46), SampleRequest(temperature=0.5, repetition_penalty=0.01, history=[1, 2, 3])]
r = sample(x.clone(), reqs)
res["sampler_errors"] = [e is not None for e in r.errors]
res["top_p0_is_argmax"] = r.token_ids[4] == int(x[4].argmax())
res["temp_tiny_is_argmax"] = r.token_ids[6] == int(x[6].argmax())

def page(i):
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, (448, 448, 3), dtype=np.uint8))

async def main():
    cfg = EngineConfig(load_format="dummy", plan=PlanRequest(device=opts.device, dtype="bfloat16"), max_model_len=4096,
                       gpu_memory_utilization=0.5, step_timeout=60)
    eng = AsyncLLMEngine(cfg)
    t0 = time.time(); await eng.start(); res["start_s"] = round(time.time() - t0, 1)
    def prompt(i):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": page(i)}, {"type": "text", "text": "OCR:"}]}]}
    async def run(rid, i, p):
        n, text = 0, []
        try:
            async for o in eng.generate(rid, prompt(i), p):
                n += len(o.delta_token_ids); text.append(o.delta_text)
            return {"ok": o.finish_reason, "tokens": n, "final_tokens": len(o.token_ids), "joined_eq": "".join(text) == o.text}
        except InvalidRequest as e:
            return {"invalid": str(e)[:90]}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}
    normal = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=0, logprobs=2)
    killers = {"top_k_2^63": dict(top_k=2**63), "seed_2^64": dict(seed=2**64), "penalty_1e-40": dict(repetition_penalty=1e-40, temperature=1.0),
               "temp_1e-46": dict(temperature=1e-46), "top_p_0": dict(top_p=0, temperature=1.0), "top_k_2^63-1": dict(top_k=2**63 - 1, temperature=1.0),
               "penalty_0.01": dict(repetition_penalty=0.01, temperature=1.0), "temp_nan": dict(temperature=float("nan"))}
    tasks = [run(f"n{i}", i, normal) for i in range(16)]
    tasks += [run(f"k-{k}", 100 + j, SamplingParams(max_tokens=32, ignore_eos=True, **kw)) for j, (k, kw) in enumerate(killers.items())]
    out = await asyncio.gather(*tasks)
    res["normal"] = out[:16]
    res["killers"] = dict(zip(killers, out[16:]))
    st = eng.stats()
    res["after"] = {"healthy": eng.healthy, "status": eng.status, "kv_used": st.kv_blocks_used, "failed": st.num_failed, "finished": st.num_finished}
    await eng.shutdown()

asyncio.run(main())
k = res["killers"]
checks = {
    "sampler: the NaN, inf and all -inf rows fail alone": res["sampler_errors"] == [False, True, False, True, False, True,
                                                                                      False, False],
    "sampler: top_p 0 and temperature 1e-46 are argmax": res["top_p0_is_argmax"] and res["temp_tiny_is_argmax"],
    "16 streams complete with 64 tokens, deltas joining to the text": all(
        n.get("ok") == "length" and n["tokens"] == n["final_tokens"] == 64 and n["joined_eq"] for n in res["normal"]),
    "top_k 2^63, seed 2^64, penalty 1e-40, temperature nan refused": all(
        "invalid" in k[name] for name in ("top_k_2^63", "seed_2^64", "penalty_1e-40", "temp_nan")),
    "temperature 1e-46, top_p 0, top_k 2^63-1, penalty 0.01 answered": all(
        k[name].get("ok") == "length" for name in ("temp_1e-46", "top_p_0", "top_k_2^63-1", "penalty_0.01")),
    "engine healthy, no KV block left, nothing failed": res["after"]["healthy"] and res["after"]["kv_used"] == 0
    and res["after"]["failed"] == 0,
}
res["checks"] = checks
print(json.dumps(res, indent=1))
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
if opts.json_out:
    with open(opts.json_out, "w") as f:
        json.dump(res, f, indent=1)
sys.exit(0 if all(checks.values()) else 1)
