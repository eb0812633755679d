"""The Acme N1 runner: hooks only. The vision path is fastdeploy_ext's shared TorchRunner; this
class says how to find the device (probe), which capability row fits it, which torch device runs
it, how to emulate it on a machine without the card, and which kernel of its own it contributes
(attention.py's ``acme_sdpa``, which its row prefers).

The N1's PyTorch plugin would expose the card as a torch device of its own; this sample has no
such plugin, so the emulated N1 runs on the CPU (its row is still its own: the plan, the suite and
every report say acme_n1 and EMULATED).
"""
from __future__ import annotations

import contextlib
import sys

import torch

from fastdeploy_ext.plan import ComponentKind
from fastdeploy_ext.torch_runner import TorchRunner

from .attention import ACME_SDPA
from .probe import probe_acme


class AcmeRunner(TorchRunner):
    name = "acme"

    @classmethod
    def probe(cls):
        return probe_acme()

    @classmethod
    def kernel_backends(cls):
        """The N1's own vision attention joins this runner's kernel table (and no other runner's)."""
        return {ComponentKind.VISION_VARLEN_ATTENTION: [ACME_SDPA]}

    @classmethod
    def row_matches(cls, row, probe) -> bool:
        fam = probe.devices[0].family if probe.devices else None
        return row.match.get("family") == fam

    @classmethod
    def torch_device(cls, probe) -> torch.device:
        if probe.emulated:
            return torch.device("cpu")
        raise RuntimeError("acme: an N1 is present but this sample ships no torch plugin for it")

    @classmethod
    def emulation(cls):
        """Install the fake acme_smi for the duration (the conformance suite and FD_EMULATE=acme
        call this); the real binding, if installed, is put back afterwards."""
        @contextlib.contextmanager
        def fake_sdk():
            from . import fake_smi
            saved = sys.modules.get("acme_smi")
            sys.modules["acme_smi"] = fake_smi
            try:
                yield
            finally:
                if saved is None:
                    sys.modules.pop("acme_smi", None)
                else:
                    sys.modules["acme_smi"] = saved
        return fake_sdk()
