"""A model family from outside fastdeploy_ext plugs in through its entry point and passes the
conformance suite: tests/toy_family/ is toy_vlm (a tiny VLM, 1D rope, fixed-size patch encoder,
byte tokenizer, its own float64 torch reference). These tests install it the way a model
engineer's CI would — `pip install --no-deps` into a temporary target directory put on the path,
so that the registry finds it through the ``fastdeploy_ext.models`` entry point — then check its
pieces against its reference in this process and run the conformance suite on it in a
subprocess. Nothing in fastdeploy_ext/ or backends/ knows it. Runs in the matrix's
cpu/toy-family leg. (What needs the engine's family-neutral prompt contract is in
test_toy_family_engine.py.)
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tests" / "toy_family"


def install_toy(tmp: Path) -> Path:
    """pip install --no-deps of tests/toy_family into ``tmp``/site; returns that directory."""
    src = shutil.copytree(PACKAGE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    # the framework is the one under test, already importable; this environment's setuptools
    # builds it when there is one (no index needed), as tests/test_oot_backend.py does
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                    "--disable-pip-version-check", "--target", str(target), str(src)], check=True)
    assert (target / "fdx_toy" / "family.py").is_file()
    return target


def env_with(target: Path | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(([str(target)] if target else []) + [str(ROOT)] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run(env, *args, **kw):
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw)


def installed_toy(tmp_path_factory) -> Path:
    """The session's one install (both toy test modules use it)."""
    base = tmp_path_factory.getbasetemp() / "toy_install"
    if not (base / "site" / "fdx_toy" / "family.py").is_file():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        install_toy(base)
    return base / "site"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return installed_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def toy(site):
    """The installed package importable in this process: the registry finds the family through
    its entry point (importlib.metadata reads the dist-info on sys.path), not register_family."""
    from fastdeploy_ext.models import registry
    sys.path.insert(0, str(site))
    try:
        fam = registry.get_family("toy_vlm")
        yield fam
    finally:
        sys.path.remove(str(site))
        registry._REGISTRY.pop("toy_vlm", None)


@pytest.fixture(scope="module")
def model_dir(toy, tmp_path_factory):
    from fdx_toy.loader import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("toy_model") / "m")


@pytest.fixture(scope="module")
def images(toy, tmp_path_factory):
    from fdx_toy.conformance import write_images
    return write_images(tmp_path_factory.mktemp("toy_images"))


def make_runner(model_dir, with_text=False, **req):
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class
    r = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32", **req))
    r.load_model(str(model_dir), with_text=with_text)
    return r


# ------------------------------------------------------------------ registration
def test_the_framework_does_not_know_the_toy_family():
    hits = [str(p.relative_to(ROOT)) for d in ("fastdeploy_ext", "backends") for p in (ROOT / d).rglob("*")
            if p.is_file() and p.suffix in (".py", ".yaml", ".json", ".txt")
            and any(w in p.read_text(errors="ignore") for w in ("toy_vlm", "fdx_toy"))]
    assert hits == []


DETECT = ("import sys; from fastdeploy_ext.models.registry import detect_family; "
          "c = detect_family(sys.argv[1]); print(c.family.name, '|', c.reason)")


def test_the_entry_point_registers_the_family_and_config_json_selects_it(site, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "toy_vlm"}')
    r = run(env_with(site), "-c", DETECT, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "toy_vlm | config.json model_type 'toy_vlm'"
    # without the install there is no such family, and the error lists the known ones
    r = run(env_with(None), "-c", DETECT, str(tmp_path))
    assert r.returncode != 0 and "model_type 'toy_vlm' belongs to no registered model family" in r.stderr
    assert "paddleocr_vl (model_type paddleocr_vl)" in r.stderr


# ------------------------------------------------------------------ the family's pieces
def test_loader_reads_the_fixture_checkpoint_and_names_what_is_wrong(toy, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from fastdeploy_ext.models.interface import CheckpointError
    runner = make_runner(model_dir)
    assert runner.family.name == "toy_vlm" and runner.load_report.layout == "torch"
    assert runner.plan.components == toy.components(toy.default_config())
    assert [c.head_dim for c in runner.plan.components] == [16, 16]
    tensors = load_file(str(model_dir / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(model_dir / "config.json", bad / "config.json")
    save_file({k: v for k, v in tensors.items() if k != "vision.proj2.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="vision.proj2.weight is missing"):
        make_runner(bad)
    save_file({**tensors, "text.lm_head.weight": tensors["text.lm_head.weight"][:10]}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"text.lm_head.weight has shape \[10, 64\]"):
        make_runner(bad, with_text=True)
    with pytest.raises(CheckpointError, match="torch layout only"):
        make_runner(model_dir).load_model(str(model_dir), model_format="paddle")
    (bad / "config.json").write_text('{"model_type": "toy_vlm", "image_size": 30}')
    with pytest.raises(CheckpointError, match="image_size 30 is not a multiple of patch_size 8"):
        make_runner(bad)


def test_every_image_becomes_the_fixed_grid_of_patches(toy, images):
    from PIL import Image
    proc = toy.image_processor(None)
    for p in images:
        im = proc.preprocess(p)
        assert tuple(im.pixel_values.shape) == (16, 3, 8, 8) and im.grid_thw == (1, 4, 4)
    # a flat colour: every patch value is (v / 255 - 0.5) / 0.5 of its channel
    flat = proc.preprocess(Image.new("RGB", (13, 71), (255, 0, 51)))
    want = torch.tensor([1.0, -1.0, 51 / 255 * 2 - 1]).view(1, 3, 1, 1).expand(16, 3, 8, 8)
    assert torch.allclose(flat.pixel_values, want, atol=1e-6)
    assert flat.original_size == (71, 13) and flat.resized_size == (32, 32)


def test_prompt_expands_each_image_to_its_embeddings_with_1d_positions(toy):
    from fdx_toy.prompt import PromptError
    cfg = toy.default_config()
    tok, tpl = toy.load_tokenizer(None, cfg)
    assert tok.decode(tok.encode("héllo <image>"), skip_special_tokens=False) == "héllo <image>"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "page.png"}},
                                         {"type": "text", "text": "b"}, {"type": "image"}]}]
    p = toy.build_prompt(tok, tpl, cfg, messages=msgs, image_grids=[(1, 4, 4), (1, 4, 4)])
    assert tok.decode(p.token_ids, skip_special_tokens=False) == \
        "<s>User: a" + "<image>" * 4 + "b" + "<image>" * 4 + "\nAssistant: "
    assert [e - s for s, e in p.image_token_ranges] == [4, 4]
    assert torch.equal(p.positions, torch.arange(len(p.token_ids)).view(1, -1)) and p.rope_delta == 0
    assert p.positions.shape[0] == toy.position_rows == 1
    with pytest.raises(PromptError, match="2 image part"):
        toy.build_prompt(tok, tpl, cfg, messages=msgs, image_grids=[(1, 4, 4)])
    with pytest.raises(PromptError, match=r"grid \(1, 2, 2\)"):
        toy.build_prompt(tok, tpl, cfg, prompt="x", image_grids=[(1, 2, 2)])


@pytest.mark.parametrize("qkv_layout, grid_thw", [("strided", "host"), ("dense", "device")])
def test_encode_through_the_runner_matches_the_reference(toy, model_dir, images, qkv_layout, grid_thw):
    """TorchRunner.encode_images (the plan's varlen attention backend over the packed batch)
    against the float64 reference, one image at a time; the two plan corners agree bitwise."""
    from fdx_toy.reference import ToyReference

    from fastdeploy_ext.runner import ImageBatch
    runner = make_runner(model_dir, qkv_layout=qkv_layout, grid_thw=grid_thw)
    assert runner.plan.grid_thw.value == grid_thw and runner.plan.strided_qkv == (qkv_layout == "strided")
    ims = [toy.image_processor(str(model_dir)).preprocess(p) for p in images]
    out = runner.encode_images(ImageBatch.from_images(ims))
    ref = ToyReference(model_dir)
    assert [o.shape[0] for o in out] == [4] * len(ims)
    errs = [float((o - ref.image_features(im.pixel_values)).abs().max()) for o, im in zip(out, ims)]
    assert max(errs) <= 1e-5, errs
    # the check has teeth: another checkpoint's reference is far off
    other = ToyReference.__new__(ToyReference)
    other.cfg, other.v = ref.cfg, {k: v.roll(1, 0) for k, v in ref.v.items()}
    assert float((out[0] - other.image_features(ims[0].pixel_values)).abs().max()) > 1e-2


def test_decoder_steps_match_the_reference_logits(toy, model_dir, images):
    """Prefill of the whole prompt, then three decode steps through the paged step runner,
    against the reference's full-prompt logits ([1, n] positions: the family's position_rows)."""
    from fdx_toy.reference import ToyReference

    from fastdeploy_ext.engine.step import SeqStep, StepBatch
    from fastdeploy_ext.runner import ImageBatch
    from fastdeploy_ext.text_runner import StepError
    runner = make_runner(model_dir, with_text=True)
    im = toy.image_processor(str(model_dir)).preprocess(images[0])
    feats = runner.encode_images(ImageBatch.from_images([im]))[0]
    p = toy.build_prompt(runner.tokenizer, runner.chat_template, runner.cfg, prompt="OCR:", image_grids=[im.grid_thw])
    cont = [40, 41, 42]
    runner.init_kv_cache(8)
    table = [5, 2, 7, 0]
    rows = [runner.execute(StepBatch(True, [SeqStep(0, p.token_ids, 0, table, p.positions, 0, feats)]))[0]]
    for k, t in enumerate(cont):
        rows.append(runner.execute(StepBatch(False, [SeqStep(0, [t], len(p.token_ids) + k, table, None, 0)]))[0])
    ref = ToyReference(model_dir).logits(p.token_ids + cont, [feats])
    got = torch.stack(rows)
    err = float((got - ref[len(p.token_ids) - 1:]).abs().max())
    assert err <= 1e-4, err
    with pytest.raises(StepError, match=r"rope_positions must be \[1, "):
        runner.execute(StepBatch(True, [SeqStep(0, p.token_ids, 0, table, p.positions.expand(3, -1), 0, feats)]))


# ------------------------------------------------------------------ the conformance suite on it
def _suite(env, tmp_path, *args):
    junit = tmp_path / "toy.xml"
    r = run(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "fastdeploy_ext.conformance",
            "--fdx-backend", "cpu", f"--junitxml={junit}", *args, timeout=900)
    counts = None
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    return r, counts


def test_the_conformance_suite_passes_on_the_toy_family(site, tmp_path):
    """Every family-neutral test (encode and decoder parity against the toy's reference, bad
    batches, plan, padding-free graph checks, the host path's no-sync proof); the
    PaddleOCR-VL-only ones are deselected and named with the fact they need. Generation through
    the engine: test_toy_family_engine.py."""
    r, counts = _suite(env_with(site), tmp_path, "--fdx-family", "toy_vlm", "-k", "not test_generate")
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0 and counts["tests"] >= 20, counts
    out = r.stdout
    assert "backend=cpu family=toy_vlm" in out
    passed = passed_names(tmp_path / "toy.xml")
    assert {"test_encode_matches_transformers[torch-float32]", "test_encode_matches_transformers[torch-bfloat16]",
            "test_text_logits_fp32", "test_text_logits_bf16", "test_host_path_makes_no_sync",
            "test_bad_batch_is_a_clear_error[odd_grid]",
            "test_the_runner_stays_healthy_after_every_bad_batch"} <= passed, sorted(passed)
    not_run = [line for line in out.splitlines() if line.startswith("not run on this leg")]
    assert any("needs a family with paddle_layout, the leg's is toy_vlm" in line
               and "test_encode_matches_transformers[paddle-float32]" in line for line in not_run)
    assert any("needs a family with grid_thw_layouts" in line and "test_host_metadata_equals_device" in line
               for line in not_run)
    assert any("needs a family with shipped_references" in line for line in not_run)


def passed_names(junit: Path) -> set[str]:
    root = ET.parse(junit).getroot()
    return {c.get("name") for c in root.iter("testcase")
            if not any(ch.tag in ("failure", "error", "skipped") for ch in c)}


def test_an_unknown_family_fails_every_family_test(tmp_path):
    r, counts = _suite(env_with(None), tmp_path, "--fdx-family", "no_such_family", "-k", "test_bad_batch")
    assert r.returncode != 0 and counts["failures"] + counts["errors"] == counts["tests"] == 8, counts
    assert "unknown model family 'no_such_family'" in r.stdout


NO_FIXTURE_PLUGIN = '''
from fastdeploy_ext.models.paddleocr_vl.family import PaddleOCRVLFamily
from fastdeploy_ext.models.registry import register_family


class NoFixtureFamily(PaddleOCRVLFamily):
    name = "no_fixture"

    def conformance_fixture(self, workdir):
        return None


def pytest_configure(config):
    register_family("no_fixture", NoFixtureFamily)
'''


def test_a_family_without_a_fixture_fails_every_family_test(tmp_path):
    """The mutation: a family whose conformance_fixture is None (the interface's default) gets
    failures saying so, not a green run. Registered with register_family by a -p plugin: an
    entry point would need a second installed package for this one case."""
    (tmp_path / "no_fixture_plugin.py").write_text(NO_FIXTURE_PLUGIN)
    env = env_with(None)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    r, counts = _suite(env, tmp_path, "-p", "no_fixture_plugin", "--fdx-family", "no_fixture", "-k", "test_bad_batch")
    assert r.returncode != 0 and counts["failures"] + counts["errors"] == counts["tests"] == 8, counts
    assert "family no_fixture: the family supplies no conformance fixture" in r.stdout
