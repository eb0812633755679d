"""Fixtures of the conformance suite: the backend under test, runners built from plan requests,
tiny checkpoints in both layouts, and real images."""
from __future__ import annotations

import pytest
import torch

from ..plan import PlanRequest
from ..runner import get_backend_class


@pytest.fixture(scope="session")
def backend_name(request) -> str:
    name = request.config.getoption("--fdx-backend")
    if not name:
        pytest.fail("the conformance suite needs --fdx-backend NAME (e.g. cpu, cpu_amx, metax, cuda)")
    return name


@pytest.fixture(scope="session")
def backend_cls(backend_name):
    cls = get_backend_class(backend_name)
    probe = cls.probe()
    if not probe.present:
        pytest.fail(f"backend {backend_name}: device not present: {probe.reason}")
    return cls


@pytest.fixture(scope="session")
def make_runner(backend_cls, request):
    """make_runner(model_dir, **PlanRequest fields) -> a loaded runner."""
    def make(model_dir=None, load_format="auto", **req):
        runner = backend_cls.create(PlanRequest(device=backend_cls.name, **req))
        runner.load_model(model_dir, load_format=load_format)
        request.config._fdx_plan_line = f"row={runner.plan.row} device={runner.plan.device}"
        return runner
    return make


@pytest.fixture(scope="session")
def emulated(request) -> bool:
    return bool(getattr(request.config, "_fdx_emulated", False))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    pytest.importorskip("transformers", reason="the reference needs transformers (pip install '.[test]')")
    from .tiny_model import write_paddle_twin, write_torch_model
    root = tmp_path_factory.mktemp("tiny")
    torch_dir = write_torch_model(root / "torch")
    return {"torch": torch_dir, "paddle": write_paddle_twin(torch_dir, root / "paddle")}


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Real image files (Pillow): sizes that need no resize under the tiny preprocessor config
    (multiples of 28 within its pixel range), so transformers' two resize backends agree."""
    from PIL import Image
    root = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(1)
    paths = []
    for i, (w, h) in enumerate([(112, 56), (56, 84), (28, 28), (84, 140)]):
        arr = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        p = root / f"img{i}.png"
        Image.fromarray(arr).save(p)
        paths.append(p)
    return paths


@pytest.fixture(scope="session")
def batch_for(images):
    """batch_for(model_dir, n) -> ImageBatch of the first n images, preprocessed by our
    processor with the model dir's preprocessor_config.json."""
    from ..models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
    from ..runner import ImageBatch

    def make(model_dir, n=len(images)):
        proc = ImageProcessor(PreprocessorConfig.from_model_dir(model_dir))
        return ImageBatch.from_images([proc.preprocess(p) for p in images[:n]])
    return make
