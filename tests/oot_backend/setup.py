"""A sample out-of-tree vendor backend for fastdeploy_ext: the "Acme N1" accelerator.

It is what a vendor ships in its own repository: a runner (hooks only), a probe of the vendor's SDK
(`acme_smi`), its capability row as package data, an emulation mode for CI machines without the
card, and one entry point. Nothing in fastdeploy_ext knows it. docs/ADDING_A_BACKEND.md walks
through it; tests/test_oot_backend.py installs it with `pip install --no-deps` and runs the
conformance suite against it.
"""
from setuptools import setup

setup(
    name="fdx-acme-backend",
    version="0.1.0",
    description="Acme N1 backend for fastdeploy_ext (sample out-of-tree vendor package)",
    python_requires=">=3.10",
    packages=["fdx_acme"],
    package_data={"fdx_acme": ["capabilities.yaml"]},        # the backend's own capability rows
    install_requires=["fastdeploy_ext"],
    entry_points={"fastdeploy_ext.backends": ["acme=fdx_acme.runner:AcmeRunner"]},
)
