"""Capability rows ship with their backend (found through its entry point) and a YAML file named by
--capabilities / FD_CAPABILITIES overrides them; bad files are clear errors naming file and row."""
from __future__ import annotations

import sys
import textwrap
from importlib import resources

import pytest

import fastdeploy_ext
from fastdeploy_ext import runner as runner_mod
from fastdeploy_ext.capabilities import CapabilityError, capability_table, shipped_rows
from fastdeploy_ext.entrypoints.cli import main
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.runner import create_runner, get_backend_class


@pytest.mark.parametrize("backend,rows", [("cuda", ["cuda_sm90", "cuda_sm80", "cuda"]), ("metax", ["metax_c500"]),
                                          ("cpu_amx", ["cpu_amx", "cpu"]), ("cpu", ["cpu_amx", "cpu"])])
def test_each_builtin_ships_its_rows_through_its_entry_point(backend, rows):
    cls = get_backend_class(backend)
    got = shipped_rows(cls)
    assert list(got) == rows          # file order is preference order
    pkg = cls.__module__.rsplit(".", 1)[0].replace(".", "/")
    for row in got.values():
        assert row.source == f"{pkg}/capabilities.yaml"


def test_framework_ships_no_rows_and_the_table_is_the_union():
    assert not resources.files(fastdeploy_ext).joinpath("capabilities.yaml").is_file()
    table = capability_table(override="")
    assert set(table) == {"cpu_amx", "cpu", "cuda_sm90", "cuda_sm80", "cuda", "metax_c500"}
    # cpu and cpu_amx are two entry points of one package: its file is read once, no duplicate error
    assert sum(r.source.endswith("cpu_amx/capabilities.yaml") for r in table.values()) == 2


OUT_OF_TREE_RUNNER = '''
import torch
from fastdeploy_ext.platforms import DeviceInfo, ProbeResult
from fastdeploy_ext.torch_runner import TorchRunner


class AcmeRunner(TorchRunner):
    name = "acme"

    @classmethod
    def probe(cls):
        return ProbeResult("acme", True, True, "Acme A1 (test double on the CPU)",
                           (DeviceInfo(0, "Acme A1", None, None, "acme_a1"),))

    @classmethod
    def row_matches(cls, row, probe):
        return row.match.get("family") == probe.devices[0].family

    @classmethod
    def torch_device(cls, probe):
        return torch.device("cpu")
'''

OUT_OF_TREE_ROWS = '''
rows:
  acme_a1:
    runner: acme
    match: {family: acme_a1}
    dtypes: [float32]
    default_dtype: float32
    attention:
      - {backend: sdpa, reads_strides: false, dtypes: [float32]}
    host_grid_thw: true
    graphs: {kinds: [], default: false}
'''


@pytest.fixture
def acme_installed(tmp_path, monkeypatch):
    """An out-of-tree vendor package installed the way pip would: a dist-info with an entry
    point, the runner module and its capabilities.yaml as package data. Nothing in-tree changes."""
    pkg = tmp_path / "acme_fdx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text(OUT_OF_TREE_RUNNER)
    (pkg / "capabilities.yaml").write_text(OUT_OF_TREE_ROWS)
    dist = tmp_path / "acme_fdx-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme_fdx\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fastdeploy_ext.backends]\nacme = acme_fdx.runner:AcmeRunner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("acme_fdx", "acme_fdx.runner"):          # a fresh import from this tmp_path
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(runner_mod, "_REGISTRY", dict(runner_mod._REGISTRY))   # forget acme afterwards
    return tmp_path


def test_out_of_tree_backend_ships_its_rows(acme_installed):
    table = capability_table(override="")
    assert table["acme_a1"].runner == "acme" and table["acme_a1"].source == "acme_fdx/capabilities.yaml"
    runner = create_runner(PlanRequest(device="acme"))
    assert runner.plan.row == "acme_a1" and runner.plan.dtype.value == "float32"
    assert runner.plan.qkv_layout.value == "dense"      # its row says sdpa does not read strides here
    assert any("acme_fdx/capabilities.yaml" in n for n in runner.plan.notes)


def _write(tmp_path, text, name="override.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_override_updates_a_shipped_row_key_by_key(tmp_path):
    path = _write(tmp_path, """
        rows:
          cpu:
            default_dtype: bfloat16
        """)
    table = capability_table(override=path)
    assert table["cpu"].default_dtype == "bfloat16"
    assert table["cpu"].attention == capability_table(override="")["cpu"].attention    # other keys kept
    assert path in table["cpu"].source and "default_dtype" in table["cpu"].source
    runner = create_runner(PlanRequest(device="cpu", capabilities=path))
    assert runner.plan.dtype.value == "bfloat16"
    assert any(path in n for n in runner.plan.notes)
    # without the override the shipped default stands
    assert create_runner(PlanRequest(device="cpu")).plan.dtype.value == "float32"


def test_env_var_names_the_override(tmp_path, monkeypatch):
    path = _write(tmp_path, "rows:\n  cpu:\n    default_dtype: bfloat16\n")
    monkeypatch.setenv("FD_CAPABILITIES", path)
    assert create_runner(PlanRequest(device="cpu")).plan.dtype.value == "bfloat16"
    # the flag wins over the environment
    other = _write(tmp_path, "rows:\n  cpu:\n    default_dtype: float32\n", "other.yaml")
    assert create_runner(PlanRequest(device="cpu", capabilities=other)).plan.dtype.value == "float32"


def test_override_adds_a_row_ahead_of_the_shipped_ones(tmp_path):
    path = _write(tmp_path, """
        rows:
          cpu_amx_lab:
            runner: cpu_amx
            match: {}
            dtypes: [float32]
            default_dtype: float32
            attention:
              - {backend: sdpa, reads_strides: false, dtypes: [float32]}
            host_grid_thw: false
            graphs: {kinds: [], default: false}
        """)
    table = capability_table(override=path)
    assert list(table)[0] == "cpu_amx_lab" and "(added)" in table["cpu_amx_lab"].source
    plan = create_runner(PlanRequest(device="cpu_amx", capabilities=path)).plan
    assert plan.row == "cpu_amx_lab" and plan.grid_thw.value == "device" and plan.qkv_layout.value == "dense"
    # a whole row of the form before `kernels:` (no text_attention) gets the portable paged backend
    assert [e.backend for e in table["cpu_amx_lab"].text_attention] == ["sdpa_paged"]
    assert plan.text_attention.value == "sdpa_paged"


def test_an_old_form_override_still_updates_one_kernel_kind(tmp_path):
    """`attention:` (the key before `kernels:`) replaces the vision list; the shipped paged list stays."""
    shipped = capability_table(override="")["cuda_sm90"]
    path = _write(tmp_path, """
        rows:
          cuda_sm90:
            attention:
              - {backend: sdpa, dtypes: [bfloat16]}
        """)
    row = capability_table(override=path)["cuda_sm90"]
    assert [e.backend for e in row.attention] == ["sdpa"]
    assert row.text_attention == shipped.text_attention and row.text_attention[0].backend == "triton_paged"
    assert "kernels.vision_varlen_attention" in row.source
    # the same in the new form, one kind given: the other kind is kept too
    path = _write(tmp_path, """
        rows:
          cuda_sm90:
            kernels:
              paged_decoder_attention:
                - {backend: sdpa_paged, head_dims: [1, 512], dtypes: [bfloat16]}
        """, "new.yaml")
    row = capability_table(override=path)["cuda_sm90"]
    assert row.attention == shipped.attention and [e.backend for e in row.text_attention] == ["sdpa_paged"]


def test_a_kind_the_row_lists_no_backend_for_is_a_plan_error_naming_row_and_kind(tmp_path):
    from fastdeploy_ext.plan import PlanError, resolve_plan
    from tests.plan_facts import ALL_PRESENT
    path = _write(tmp_path, """
        rows:
          vision_only:
            runner: cpu_amx
            match: {}
            dtypes: [float32]
            default_dtype: float32
            kernels:
              vision_varlen_attention:
                - {backend: sdpa, dtypes: [float32]}
            host_grid_thw: true
            graphs: {kinds: [], default: false}
        """)
    row = capability_table(override=path)["vision_only"]
    assert row.text_attention == ()        # the new form gets no default list
    with pytest.raises(PlanError, match="row vision_only lists no backend for kernel kind paged_decoder_attention"):
        resolve_plan(row, PlanRequest(), device="cpu", head_dim=72, kernels=ALL_PRESENT)


@pytest.mark.parametrize("text,match", [
    ("rows:\n  cpu:\n    default_dtyp: bfloat16\n", r"row cpu: unknown keys \['default_dtyp'\]"),
    ("rows:\n  new_row:\n    runner: cpu_amx\n", r"new_row .*missing key 'kernels'"),
    ("rows:\n  cpu:\n    kernels: {detector_attention: []}\n",
     r"row cpu.*unknown kernel kind 'detector_attention'; known: deformable_attention, dense_attention, moe_experts, paged_decoder_attention, prefix_causal_attention, relpos_global_attention, relpos_window_attention, vision_varlen_attention"),
    ("rows:\n  cpu:\n    attention: []\n    kernels: {vision_varlen_attention: []}\n",
     r"row cpu.*gives both attention and kernels.vision_varlen_attention"),
    ("rows:\n  cpu:\n    kernels: {vision_varlen_attention: [{backend: sdpa, dtypes: [float32], graph_safe: true}]}\n",
     r"row cpu: vision_varlen_attention entry 'sdpa' has unknown keys \['graph_safe'\]"),
    ("rows:\n  cpu:\n    default_dtype: float16\n", r"cpu .*default_dtype float16 is not in its dtypes"),
    ("rows: [1, 2]\n", r"top-level 'rows:' mapping"),
    ("rows:\n  cpu: [\n", r"not valid YAML"),
])
def test_bad_override_files_are_errors_naming_file_and_row(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(CapabilityError, match=match) as e:
        capability_table(override=path)
    assert "override.yaml" in str(e.value)


def test_missing_override_file_and_cli_error(tmp_path, capsys):
    with pytest.raises(CapabilityError, match="no such file"):
        capability_table(override=str(tmp_path / "nope.yaml"))
    bad = _write(tmp_path, "rows:\n  cpu:\n    default_dtyp: bfloat16\n")
    assert main(["info", "--device", "cpu", "--capabilities", bad]) == 2
    err = capsys.readouterr().err
    assert "default_dtyp" in err and "override.yaml" in err and "Traceback" not in err


def test_the_same_row_shipped_by_two_packages_is_an_error(acme_installed):
    (acme_installed / "acme_fdx" / "capabilities.yaml").write_text(
        OUT_OF_TREE_ROWS.replace("acme_a1:", "cpu:"))
    with pytest.raises(CapabilityError, match="row cpu is shipped twice"):
        capability_table(override="")


def test_info_lists_rows_with_their_origin(tmp_path, capsys):
    path = _write(tmp_path, "rows:\n  cpu:\n    default_dtype: bfloat16\n")
    assert main(["info", "--device", "cpu", "--capabilities", path]) == 0
    out = capsys.readouterr().out
    assert "cuda_sm90" in out and "backends/cuda/capabilities.yaml" in out
    assert f"overridden by {path}" in out
    assert "dtype           = bfloat16" in out
