"""fastdeploy_ext: fast multi-vendor inference of OCR vision-language models (PaddleOCR-VL).

Entry points: the `fastdeploy-ext` command (fastdeploy_ext.entrypoints.cli), the runner
interface (fastdeploy_ext.runner) and the conformance suite (fastdeploy_ext.conformance).
"""
__version__ = "0.1.0"
