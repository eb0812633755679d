"""fastdeploy_ext: fast multi-vendor inference of OCR vision-language models (PaddleOCR-VL).

Entry points: the `fastdeploy-ext` command (fastdeploy_ext.entrypoints.cli), the runner
interface (fastdeploy_ext.runner) and the conformance suite (fastdeploy_ext.conformance).
"""
__version__ = "0.1.0"


def __getattr__(name):
    # `from fastdeploy_ext import LLM, SamplingParams` (vLLM's shape) without importing the
    # engine for every `import fastdeploy_ext`
    if name == "LLM":
        from .entrypoints.llm import LLM
        return LLM
    if name == "Detector":
        from .entrypoints.detector import Detector
        return Detector
    if name in ("DocumentParser", "ParseOptions"):
        from .parsing import parser
        return getattr(parser, name)
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'fastdeploy_ext' has no attribute {name!r}")
