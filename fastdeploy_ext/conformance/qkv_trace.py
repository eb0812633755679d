"""What "strided qkv" must mean, checked on the running encoder: the q, k and v the attention
kernel receives are views of the qkv projection's own output buffer, and nothing between the
projection and the kernel copies that buffer (or a view of it) into a dense tensor.

The projection's output is found at the ATen level — the first op that reads a layer's qkv
weight and makes a new tensor — so it is seen however the layer computes it (a functional call
on the weight, the module, a GEMM on the transposed weight); a module forward hook would miss
the functional path. The kernel's inputs are recorded by wrapping the attention backend's call.
Between the two, every op that reads the buffer and writes a new tensor of the same element
count is a copy: same dtype = a dense copy (fails the check), another dtype = a conversion for
fp32 arithmetic (reported: the ATen rotary does that in bf16, then writes back in place).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COPY_OPS = frozenset({"clone", "contiguous", "_to_copy", "to", "copy_", "_copy_from"})


@dataclass(frozen=True)
class View:
    storage: int
    data_ptr: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "View":
        return cls(t.untyped_storage().data_ptr(), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


@dataclass(frozen=True)
class Event:
    kind: str                  # "proj" | "attn" | "copy"
    views: dict                # proj: {"out": View}; attn: {"q", "k", "v": View}; copy: {"src", "out": View}
    op: str = ""


class QkvTrace(TorchDispatchMode):
    """Timeline of qkv projections, copies of their buffers and attention calls."""

    def __init__(self, qkv_weights):
        super().__init__()
        self.weights = {w.untyped_storage().data_ptr() for w in qkv_weights}
        self.events: list[Event] = []
        self._buffers: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out_storage = out.untyped_storage().data_ptr()
        new = all(t.untyped_storage().data_ptr() != out_storage for t in ins)
        if new and any(t.untyped_storage().data_ptr() in self.weights for t in ins):
            self.events.append(Event("proj", {"out": View.of(out)}, str(func)))
            self._buffers = {out_storage}     # only the live one: freed addresses get reused
            return out
        name = func.overloadpacket.__name__
        src = args[1] if name in ("copy_", "_copy_from") else (args[0] if args else None)
        if name in COPY_OPS and isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() in self._buffers \
                and out_storage != src.untyped_storage().data_ptr() and out.numel() == src.numel():
            self.events.append(Event("copy", {"src": View.of(src), "out": View.of(out)}, str(func)))
        return out

    def attention_call(self, inner):
        """``inner`` (an attention backend's call) wrapped to record what it receives and when it
        returns: copies made inside the launcher (e.g. an alignment copy) count too."""
        def call(q, k, v, *args, **kwargs):
            self.events.append(Event("attn", {"q": View.of(q), "k": View.of(k), "v": View.of(v)}))
            try:
                return inner(q, k, v, *args, **kwargs)
            finally:
                self.events.append(Event("attn_end", {}))
        return call

    def recording(self, backend) -> "_RecordingBackend":
        """``backend`` with its call recorded, every other attribute its own."""
        return _RecordingBackend(backend, self)


class _RecordingBackend:
    """Stands in for an attention backend: the call (``backend(...)`` or ``backend.fn(...)``)
    is recorded by the trace, every other attribute is the backend's."""

    def __init__(self, inner, trace: QkvTrace):
        self._inner, self._trace = inner, trace

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        return self._trace.attention_call(value) if name == "fn" else value

    def __call__(self, q, k, v, *args, **kwargs):
        return self._trace.attention_call(self._inner)(q, k, v, *args, **kwargs)


def trace_encoder(runner, batch) -> QkvTrace:
    """Encode ``batch`` with ``runner`` (its plan as is) under a QkvTrace, its attention
    backend's call wrapped to record what the kernel receives."""
    layers = runner.model.encoder.layers
    trace = QkvTrace([layer.qkv.weight for layer in layers])
    saved = runner.execution
    runner.execution = dataclasses.replace(saved, attention=trace.recording(saved.attention))
    try:
        with trace:
            runner.encode_images(batch)
    finally:
        runner.execution = saved
    return trace


def check_views_of_projection(trace: QkvTrace, hidden: int, head_dim: int) -> list[str]:
    """AssertionError unless every attention call got q, k, v as views of the latest projection
    output ([N, 3*hidden]: q | k | v thirds of each row) with no dense copy of it in between.
    Returns the conversions seen (dtype-changing reads of the buffer), for the report."""
    proj, copies, attn_calls, conversions = None, [], 0, []
    for ev in trace.events:
        if ev.kind == "proj":
            proj, copies = ev.views["out"], []
        elif ev.kind == "copy":
            copies.append(ev)
        elif ev.kind == "attn_end":          # copies up to the kernel's return count (launcher included)
            dense = [c for c in copies if c.views["out"].dtype == c.views["src"].dtype]
            assert not dense, f"the qkv buffer was copied dense before the kernel: {[c.op for c in dense]}"
            conversions += [f"{c.op} {c.views['src'].dtype}->{c.views['out'].dtype}" for c in copies]
            proj = None                      # one attention call per projection
        elif ev.kind == "attn":
            attn_calls += 1
            assert proj is not None, "attention ran before any qkv projection was seen"
            assert proj.shape[-1] == 3 * hidden, f"projection output {proj.shape} is not [N, {3 * hidden}]"
            elt = torch.empty((), dtype=proj.dtype).element_size()
            for i, name in enumerate("qkv"):
                v = ev.views[name]
                assert v.storage == proj.storage, (
                    f"{name} is not a view of the qkv projection's output (storage {v.storage:#x}, "
                    f"projection wrote {proj.storage:#x})")
                assert v.data_ptr == proj.data_ptr + i * hidden * elt, f"{name} starts at the wrong column"
                assert v.stride == (proj.stride[0], head_dim, 1) and proj.stride[0] == 3 * hidden, (
                    f"{name} strides {v.stride}: expected ({3 * hidden}, {head_dim}, 1)")
    assert attn_calls > 0, "no attention call was recorded"
    return sorted(set(conversions))
