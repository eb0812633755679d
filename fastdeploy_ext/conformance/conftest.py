"""Fixtures of the conformance suite: the backend under test, runners built from plan requests,
and the family under test's tiny models and references (``--fdx-family``, default the default
family): its ``ConformanceFixture`` (family_fixture.py) gives the model dirs, the images and the
expected outputs. Nothing here needs transformers; a missing reference fails the test."""
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
def family_name(request) -> str:
    from .plugin import family_option
    return family_option(request.config)


@pytest.fixture(scope="session")
def family_fixture(request, family_name):
    """The family's ConformanceFixture (made once per session by the plugin, which also reads
    its facts to deselect what the family does not have)."""
    from .plugin import family_fixture_of
    fx, error = family_fixture_of(request.config)
    if fx is None:
        pytest.fail(f"family {family_name}: {error}")
    return fx


@pytest.fixture(scope="session")
def make_runner(backend_cls, family_name, request):
    """make_runner(model_dir, **PlanRequest fields) -> a loaded runner of the family under test
    (with_text=True: the text decoder, tokenizer and chat template too)."""
    def make(model_dir=None, load_format="auto", with_text=False, **req):
        runner = backend_cls.create(PlanRequest(device=backend_cls.name, **req))
        runner.load_model(model_dir, load_format=load_format, with_text=with_text, model_family=family_name)
        request.config._fdx_plan_line = f"row={runner.plan.row} device={runner.plan.device}"
        return runner
    return make


@pytest.fixture(scope="session")
def emulated(request) -> bool:
    return bool(getattr(request.config, "_fdx_emulated", False))


@pytest.fixture(scope="session")
def references():
    """The manifest of the shipped reference data (tests of FamilyFact.SHIPPED_REFERENCES)."""
    from .references import Manifest
    return Manifest.load()


@pytest.fixture(scope="session")
def encode_case(family_fixture):
    return family_fixture.encode_case()


@pytest.fixture(scope="session")
def tiny_models(encode_case):
    """The family's tiny checkpoints (read only) by weight layout: "torch", and e.g. "paddle"
    (the same weights in Paddle layout) for families with FamilyFact.PADDLE_LAYOUT."""
    return encode_case.model_dirs


@pytest.fixture(scope="session")
def batch_for(encode_case):
    """batch_for(model_dir, n) -> ImageBatch of the first n images, preprocessed by the family's
    processor with the model dir's settings."""
    def make(model_dir, n=encode_case.num_images):
        return encode_case.batch(model_dir, n)
    return make


@pytest.fixture(scope="session")
def detect_case(request):
    """The detector family's parity case (``--fdx-detector-family``: test_detector.py runs each
    of its families as a parameter): tiny checkpoint, pixels, reference outputs, goldens."""
    from .plugin import detector_fixture_of
    fx, error = detector_fixture_of(request.config, getattr(request, "param", None))
    if fx is None:
        pytest.fail(f"detector family: {error}")
    return fx.detect_case()


@pytest.fixture(scope="session")
def make_detector_runner(backend_cls):
    """make_detector_runner(model_dir, **PlanRequest fields) -> a runner of the backend under test
    with the detector loaded. The first plan is resolved for the checkpoint's detector family
    (a detector-only request, e.g. detector graphs, is refused by a VLM family's plan)."""
    from ..models.registry import detect_family

    def make(model_dir, **req):
        req.setdefault("model_family", detect_family(str(model_dir)).family.name)
        runner = backend_cls.create(PlanRequest(device=backend_cls.name, **req))
        runner.load_detector(model_dir)
        return runner
    return make
