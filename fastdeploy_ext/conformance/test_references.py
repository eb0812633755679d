"""The shipped references are complete and intact, and a missing or altered one is an error
(never a skip): the suite cannot pass with its numerics unchecked."""
from __future__ import annotations

import shutil

import pytest

from .family_fixture import FamilyFact
from .make_references import PRODUCERS
from .references import Manifest, MissingReference

pytestmark = pytest.mark.fdx_family_fact(FamilyFact.SHIPPED_REFERENCES)


def test_every_producer_has_an_intact_entry(references):
    assert {p.name for p in PRODUCERS} <= set(references.entries)
    for name in references.entries:
        assert references.path(name).exists()          # every file present with its recorded sha256


@pytest.fixture
def copied(references, tmp_path):
    root = tmp_path / "refs"
    shutil.copytree(references.root, root)
    return root


def test_a_missing_file_is_an_error(copied):
    (copied / "expected" / "encoder_features.safetensors").unlink()
    with pytest.raises(MissingReference, match="encoder_features.*missing.*make_references"):
        Manifest.load(copied).tensors("encoder_features")


def test_an_altered_file_is_an_error(copied):
    f = copied / "tiny_torch" / "config.json"
    f.write_text(f.read_text().replace("144", "145"))
    with pytest.raises(MissingReference, match="tiny_torch.*sha256"):
        Manifest.load(copied).path("tiny_torch")


def test_an_unlisted_reference_is_an_error(copied):
    with pytest.raises(MissingReference, match="greedy_token_ids.*not in"):
        Manifest.load(copied).path("greedy_token_ids")


def test_a_missing_manifest_is_an_error(copied):
    (copied / "manifest.json").unlink()
    with pytest.raises(MissingReference, match="manifest is missing"):
        Manifest.load(copied)
