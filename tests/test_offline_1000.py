"""Issue 8's soak test: 1000 requests through the offline API on the tiny model on the CPU are
all answered and the KV pool ends empty (tiny model, tiny images, 2 tokens each: fast)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fastdeploy_ext import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    pytest.importorskip("transformers")
    from fastdeploy_ext.conformance.tiny_text_model import write_tiny_vl_model
    return write_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"))


def test_1000_requests_all_answered_pool_empty(tiny_vl):
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 256, (28 * (1 + i % 2), 28 * (1 + i % 3), 3), dtype=np.uint8))
            for i in range(50)]
    llm = LLM(str(tiny_vl), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
              max_num_seqs=128, preprocess_workers=2)
    reqs = [{"prompt": "OCR:", "multi_modal_data": {"image": imgs[i % 50]}} for i in range(1000)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=2 + i % 2) for i in range(1000)]
    outs = llm.generate(reqs, params, use_tqdm=False)
    assert len(outs) == 1000 and all(o is not None for o in outs)
    assert all(o.outputs[0].finish_reason in ("stop", "length") and 1 <= len(o.outputs[0].token_ids) <= 3
               for o in outs)
    st = llm.engine.stats()
    assert st.num_finished == 1000 and st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks
    # same image, same greedy prompt -> same tokens, whatever the batch
    greedy = {}
    for i, o in enumerate(outs):
        if i % 2 and len(o.outputs[0].token_ids) == 3 and o.outputs[0].finish_reason == "length":
            greedy.setdefault(i % 50, set()).add(tuple(o.outputs[0].token_ids))
    assert greedy and all(len(v) == 1 for v in greedy.values())
