"""`bench parse --plots DIR`: the stage breakdown and the GPU-busy timeline as PNG charts
(bench/parse_plots.py, matplotlib from the [plots] extra); without matplotlib a one-line error
before anything runs."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from . import pp_doclayout_fixture as fx

pytest.importorskip("matplotlib", reason="the [plots] extra (matplotlib) is not installed")

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(path).convert("RGB"))


def _has_colour(pic: np.ndarray, hex_colour: str, at_least: int = 50) -> bool:
    rgb = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return int(np.all(pic == rgb, axis=-1).sum()) >= at_least


def _run(name: str, pages_per_s: float, timeline) -> dict:
    stages = {"render_s": 1.0, "layout_s": 0.5, "post_s": 0.2, "prefill_s": 2.0, "decode_s": 6.0, "assemble_s": 0.1,
              "write_s": 0.1, "idle_s": 0.4}
    return {"name": name, "pages_per_s": pages_per_s, "wall_s": 10.0, "stages_s": stages,
            "gpu_busy_pct": float(np.mean([b for _, b in timeline])) if timeline else None,
            "gpu_busy_timeline": timeline}


def test_the_charts_show_both_runs_stages_and_timelines(tmp_path):
    from fastdeploy_ext.bench.parse_plots import RUN_COLOURS, write_plots
    line = [[i * 0.05, 50 + 40 * np.sin(i / 10)] for i in range(200)]
    report = {"pages": 64, "stub_vlm": False, "ours": _run("ours", 6.4, line),
              "baseline": _run("paddlex-style", 3.2, [[t, b / 2] for t, b in line])}
    paths = write_plots(report, tmp_path / "plots")
    assert [p.name for p in paths] == ["stages.png", "gpu_busy.png"]
    for p in paths:
        pic = _pixels(p)
        assert pic.shape[1] == 800                      # 8 in at 100 dpi
        for colour in RUN_COLOURS.values():             # both runs drawn in each chart
            assert _has_colour(pic, colour), (p.name, colour)


def test_without_a_utilization_reader_the_timeline_says_so(tmp_path):
    from fastdeploy_ext.bench.parse_plots import RUN_COLOURS, write_plots
    report = {"pages": 2, "stub_vlm": True, "ours": _run("ours", 1.0, []), "baseline": None}
    stages, busy = write_plots(report, tmp_path)
    assert _has_colour(_pixels(stages), RUN_COLOURS["ours"])
    assert not _has_colour(_pixels(busy), RUN_COLOURS["ours"], at_least=1)


def test_bench_parse_plots_from_the_command(tmp_path, capsys):
    from fastdeploy_ext.entrypoints.cli import main
    layout = tmp_path / "layout"
    fx.write_model(layout)
    out = tmp_path / "plots"
    assert main(["bench", "parse", "--pdf", str(PDFS), "--pages", "2", "--stub-vlm", "--json", "--no-baseline",
                 "--warmup-pages", "0", "--layout-model", str(layout), "--device", "cpu", "--dtype", "float32",
                 "--render-workers", "1", "--plots", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gpu_busy.png", "stages.png"]
    assert _pixels(out / "stages.png").shape[:2] == (450, 800)


def test_without_matplotlib_a_one_line_error_before_the_run(tmp_path, capsys, monkeypatch):
    from fastdeploy_ext.entrypoints.cli import main
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib -> ImportError
    rc = main(["bench", "parse", "--stub-vlm", "--device", "cpu",
               "--plots", str(tmp_path / "plots")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "--plots needs matplotlib" in err and "fastdeploy_ext[plots]" in err
    assert not (tmp_path / "plots").exists()
