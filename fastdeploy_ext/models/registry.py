"""The model-family registry: name -> Family (a VLM's ModelFamily or a DetectorFamily), and which family a model directory holds.

Families register under the entry-point group ``fastdeploy_ext.models`` (setup.py registers the
built-in ``paddleocr_vl`` there, exactly as an out-of-tree family registers in its own
distribution). ``BUILTIN_FAMILIES`` names the same targets: it is the fallback for an installed
distribution whose metadata predates an entry point (an editable install is only re-read on
``pip install -e``), and tests/test_registry.py checks that it agrees with setup.py. An entry
point of the same name wins over the fallback; a registered class (``register_family``) wins
over both. Targets are loaded by name, so this module imports no family.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from .interface import Family, read_config_json

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fastdeploy_ext.models"
DEFAULT_FAMILY = "paddleocr_vl"      # dummy weights and `info` without a model
DEFAULT_DETECTOR_FAMILY = "pp_doclayout_v3"      # `detect --load-format dummy`
BUILTIN_FAMILIES = {"paddleocr_vl": "fastdeploy_ext.models.paddleocr_vl.family:PaddleOCRVLFamily",
                    "pp_doclayout_v3": "fastdeploy_ext.models.pp_doclayout_v3.family:PPDocLayoutV3Family",
                    "pp_doclayout_v2": "fastdeploy_ext.models.pp_doclayout_v2.family:PPDocLayoutV2Family",
                    "deepseek_ocr2": "fastdeploy_ext.models.deepseek_ocr2.family:DeepseekOCR2Family"}

_REGISTRY: dict[str, type[Family]] = {}


def register_family(name: str, cls: type[Family]) -> None:
    """For tests and embedding; installed families use the entry-point group instead."""
    _REGISTRY[name] = cls


def _entry_points() -> dict[str, EntryPoint]:
    eps = {name: EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in BUILTIN_FAMILIES.items()}
    eps.update({ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return eps


def available_families() -> dict[str, type[Family]]:
    for name, ep in _entry_points().items():
        if name in _REGISTRY:
            continue
        try:
            _REGISTRY[name] = ep.load()
        except Exception as e:  # a broken third-party family must not take the others down
            log.warning("model family %s (%s) failed to load: %s", name, ep.value, e)
    return dict(_REGISTRY)


def get_family(name: str) -> Family:
    families = available_families()
    if name not in families:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(sorted(families)) or 'none'} "
                         f"(families register via the '{ENTRY_POINT_GROUP}' entry points)")
    return families[name]()


@dataclass(frozen=True)
class FamilyChoice:
    family: Family
    reason: str


def _known(families: dict[str, type[Family]]) -> str:
    return "; ".join(f"{n} (model_type {', '.join(c.model_types)})" for n, c in sorted(families.items()))


def detect_family(model_dir: str | None, override: str | None = None) -> FamilyChoice:
    """The family of ``model_dir``: ``override`` (``--model-family``) when given, else the one
    whose ``model_types`` hold config.json's ``model_type``. Without a directory (dummy weights)
    or a ``model_type`` key, the default family, with that reason. An unknown model_type is an
    error listing the known families."""
    if override:
        return FamilyChoice(get_family(override), f"--model-family {override}")
    if model_dir is None:
        return FamilyChoice(get_family(DEFAULT_FAMILY), f"no model directory: the default family {DEFAULT_FAMILY}")
    data, path = read_config_json(model_dir)
    model_type = data.get("model_type")
    if model_type is None:
        return FamilyChoice(get_family(DEFAULT_FAMILY),
                            f"{path} has no model_type: the default family {DEFAULT_FAMILY}")
    families = available_families()
    for name, cls in sorted(families.items()):
        if model_type in cls.model_types:
            return FamilyChoice(cls(), f"config.json model_type {model_type!r}")
    raise ValueError(f"{path}: model_type {model_type!r} belongs to no registered model family; known: "
                     f"{_known(families)}. Pass --model-family NAME to choose one.")
