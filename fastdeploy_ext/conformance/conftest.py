"""Fixtures of the conformance suite: the backend under test, runners built from plan requests,
and the shipped references (references.py): tiny checkpoints in both layouts, real images and
the expected outputs. Nothing here needs transformers; a missing reference fails the test."""
from __future__ import annotations

import pytest

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
    """make_runner(model_dir, **PlanRequest fields) -> a loaded runner (with_text=True: the
    text decoder, tokenizer and chat template too)."""
    def make(model_dir=None, load_format="auto", with_text=False, **req):
        runner = backend_cls.create(PlanRequest(device=backend_cls.name, **req))
        runner.load_model(model_dir, load_format=load_format, with_text=with_text)
        request.config._fdx_plan_line = f"row={runner.plan.row} device={runner.plan.device}"
        return runner
    return make


@pytest.fixture(scope="session")
def emulated(request) -> bool:
    return bool(getattr(request.config, "_fdx_emulated", False))


@pytest.fixture(scope="session")
def references():
    from .references import Manifest
    return Manifest.load()


@pytest.fixture(scope="session")
def tiny_models(references):
    """The shipped checkpoints (read only): torch layout and its sharded Paddle-layout twin."""
    return {"torch": references.path("tiny_torch"), "paddle": references.path("tiny_paddle")}


@pytest.fixture(scope="session")
def images(references):
    """Real image files (PNG) whose sizes need no resize under the tiny preprocessor config
    (multiples of 28 within its pixel range), so transformers' two resize backends agree."""
    return references.files("images")


@pytest.fixture(scope="session")
def batch_for(images):
    """batch_for(model_dir, n) -> ImageBatch of the first n images, preprocessed by our
    processor with the model dir's preprocessor_config.json."""
    from .make_references import processed_batch

    def make(model_dir, n=len(images)):
        return processed_batch(model_dir, images[:n])
    return make
