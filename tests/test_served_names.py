"""Served model names: several with --served-model-name (vLLM's nargs='+'), and the default
registers the --model path as typed and the directory's own name (what PaddleX sends)."""
from __future__ import annotations

import pytest

from fastdeploy_ext.entrypoints.openai import cli_args
from fastdeploy_ext.entrypoints.openai.api_server import build_parser


@pytest.mark.parametrize("model_dir, names", [
    ("/models/PaddleOCR-VL-0.9B", ("/models/PaddleOCR-VL-0.9B", "PaddleOCR-VL-0.9B")),
    ("/models/PaddleOCR-VL-0.9B/", ("/models/PaddleOCR-VL-0.9B/", "PaddleOCR-VL-0.9B")),
    ("PaddleOCR-VL", ("PaddleOCR-VL",)),            # already the bare name: listed once
    (None, ("dummy",)),
])
def test_default_served_names(model_dir, names):
    assert cli_args.default_served_names(model_dir) == names


def test_several_served_names_first_is_answered_duplicates_dropped():
    ns = build_parser().parse_args(["--load-format", "dummy", "--served-model-name", "PaddleOCR-VL-0.9B", "ocr",
                                    "PaddleOCR-VL-0.9B"])
    cfg = cli_args.server_config_from_args(ns, cli_args.default_served_names(None))
    assert cfg.served_model_names == ("PaddleOCR-VL-0.9B", "ocr")
    ns = build_parser().parse_args(["--load-format", "dummy"])
    assert cli_args.server_config_from_args(ns, ("/m/x", "x")).served_model_names == ("/m/x", "x")
