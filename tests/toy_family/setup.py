"""A sample out-of-tree model family for fastdeploy_ext: "toy_vlm", a tiny VLM.

It is what a model engineer ships in their own repository: the family's hooks, its modules, a
loader from safetensors, its processor and prompt builder, a plain torch reference, its
conformance fixture, and one entry point. Nothing in fastdeploy_ext knows it.
docs/ADDING_A_MODEL.md walks through it; tests/test_toy_family.py installs it with
`pip install --no-deps` and runs the conformance suite on it.
"""
from setuptools import setup

setup(
    name="fdx-toy-vlm",
    version="0.1.0",
    description="toy_vlm model family for fastdeploy_ext (sample out-of-tree model package)",
    python_requires=">=3.10",
    packages=["fdx_toy"],
    install_requires=["fastdeploy_ext"],
    entry_points={"fastdeploy_ext.models": ["toy_vlm=fdx_toy.family:ToyVLMFamily"]},
)
