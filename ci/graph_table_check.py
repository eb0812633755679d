"""GPU check of the graph budget's padded block table: device time of the varlen kernel for one
8x40 block (320 tokens) in a 512-token budget, with the real rows only vs padded with the no-op
rows a captured graph carries (each computes one masked tile and stores nothing), and their
outputs equal. Written to measure an early exit for those rows (next step in
docs/PERFORMANCE.md); not yet run: the session's device time was spent.

    python3 ci/graph_table_check.py
"""
import torch

from fastdeploy_ext.ops.triton import varlen_attention as ta

n, h, d = 512, 16, 72
qkv = torch.randn(n, 3 * h * d, device="cuda", dtype=torch.bfloat16)
q, k, v = qkv.view(n, 3, h, d).unbind(1)
real = ta.build_block_table([320]).cuda()
padded = torch.cat([real, ta.noop_block_table(n // ta.BLOCK_M + 64 - real.shape[0], "cuda")])
outs = {}
for name, bt in (("real rows only", real), ("padded like a graph", padded)):
    out = torch.zeros(n, h, d, device="cuda", dtype=torch.bfloat16)
    ta.varlen_attention(q, k, v, bt, 320, d ** -0.5, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            ta.varlen_attention(q, k, v, bt, 320, d ** -0.5, out=out)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        g.replay()
    e.record()
    e.synchronize()
    outs[name] = out
    print(f"{name:<22} rows {bt.shape[0]:3d}: {s.elapsed_time(e) / 100 * 1000:7.1f} us per call")
print("outputs equal:", torch.equal(outs["real rows only"], outs["padded like a graph"]))
