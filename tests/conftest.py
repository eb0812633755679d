pytest_plugins = ["pytester"]

import pytest


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from fastdeploy_ext.conformance.tiny_model import write_paddle_twin, write_torch_model
    root = tmp_path_factory.mktemp("models")
    t = write_torch_model(root / "torch")
    return {"torch": t, "paddle": write_paddle_twin(t, root / "paddle")}


@pytest.fixture(scope="session")
def png_files(tmp_path_factory):
    import numpy as np
    from PIL import Image
    root = tmp_path_factory.mktemp("png")
    rng = np.random.default_rng(0)
    out = []
    for i, (w, h) in enumerate([(112, 56), (56, 84), (140, 84)]):
        p = root / f"page{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        out.append(p)
    return out
