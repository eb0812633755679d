"""MetaX MACA runner.

Probes through pymxsml (ships with the MACA SDK; imported lazily by the probe). MACA's PyTorch
exposes the card as a `cuda` device, so the vision path is the shared torch one on that device;
what differs is the row: dense qkv (its SDPA is not verified to read strides), host grid_thw (as
FastDeploy's MetaX PaddleOCR-VL runner does), graph capture opt-in only.

Emulation (``emulation()``, asked for by the conformance suite when no card is found and by
``FD_EMULATE=metax``): a fake pymxsml mirroring MetaX's binding (fake_pymxsml.py) is installed
for the probe; the runner then executes its own code and row on whatever torch device exists
(the CPU here, the GPU of the NVIDIA test machine) and every report says EMULATED.

Memory, pinned staging, graphs and the sync guard are the device API of the torch device
(fastdeploy_ext/device_api.py): on a real card, or emulated on an NVIDIA GPU, that device is
``cuda`` and the CUDA backend's API serves it; emulated on the host it is the host's.
"""
from __future__ import annotations

import torch

from fastdeploy_ext.plan import CapabilityRow
from fastdeploy_ext.torch_runner import TorchRunner

from . import fake_pymxsml
from .probe import probe_metax


class MetaxRunner(TorchRunner):
    name = "metax"

    @classmethod
    def probe(cls):
        return probe_metax()

    @classmethod
    def emulation(cls):
        return fake_pymxsml.installed()

    @classmethod
    def row_matches(cls, row: CapabilityRow, probe) -> bool:
        fam = probe.devices[0].family if probe.devices else None
        return row.match.get("family") in (None, fam)

    @classmethod
    def select_row(cls, probe, table):
        try:
            return super().select_row(probe, table)
        except RuntimeError:
            # an unknown MetaX part: run with the most conservative MetaX row rather than refuse
            rows = [r for r in table.values() if r.runner == cls.name]
            if not rows:
                raise
            fam = probe.devices[0].family if probe.devices else "unknown"
            return rows[0], f"no row for {fam}; using {rows[0].name}, the conservative MetaX row"

    @classmethod
    def torch_device(cls, probe) -> torch.device:
        if torch.cuda.is_available():          # MACA torch builds expose the card as cuda
            return torch.device("cuda", 0)
        if probe.emulated:
            return torch.device("cpu")
        raise RuntimeError("metax: pymxsml sees a card but torch cannot reach it (is this the MACA torch build?)")

    def memory_stats(self) -> dict:
        stats = super().memory_stats()
        if self.plan.emulated:
            stats["kind"] += " [EMULATED MetaX]"
        return stats
