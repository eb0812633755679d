"""`bench parse --plots DIR`: the report as two PNG charts, ``stages.png`` (seconds per pipeline
stage, ours beside the PaddleX-style baseline) and ``gpu_busy.png`` (the GPU's utilization over
each run, as sampled every 50 ms). matplotlib is an optional extra (``pip install
fastdeploy_ext[plots]``), imported only here."""
from __future__ import annotations

from pathlib import Path

from . import BenchError

#: the report's stage timers, in pipeline order, with their chart names
STAGES = (("render_s", "render"), ("layout_s", "layout"), ("post_s", "post / crops"),
          ("prefill_s", "VLM prefill"), ("decode_s", "VLM decode"), ("assemble_s", "assemble"),
          ("write_s", "write"), ("idle_s", "engine idle"))
RUN_COLOURS = {"ours": "#1f77b4", "paddlex-style": "#ff7f0e"}
FILES = ("stages.png", "gpu_busy.png")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plots needs matplotlib: pip install 'fastdeploy_ext[plots]'") from None
    matplotlib.use("Agg")           # files only: no display, whatever the environment says
    import matplotlib.pyplot as plt
    return plt


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    """The two charts of a `bench parse` report into ``out_dir`` (created); their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in (report["ours"], report.get("baseline")) if r is not None]
    title = f"bench parse: {report['pages']} pages" + (" (stub VLM)" if report.get("stub_vlm") else "")

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    height = 0.8 / len(runs)
    for i, r in enumerate(runs):
        ys = [k + i * height for k in range(len(STAGES))]
        ax.barh(ys, [r["stages_s"].get(key, 0.0) for key, _ in STAGES], height=height,
                color=RUN_COLOURS.get(r["name"], "#888"),
                label=f"{r['name']}: {r['pages_per_s']:.2f} pages/s, {r['wall_s']:.1f} s wall")
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(STAGES))], [name for _, name in STAGES])
    ax.invert_yaxis()
    # render and the engine's steps overlap in time: the bars are each stage's own seconds, not a split of the wall
    ax.set_xlabel("seconds in the stage (summed over its threads; stages overlap)")
    ax.set_title(title + ": stage breakdown")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    stages = out / FILES[0]
    fig.savefig(stages)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    drawn = False
    for r in runs:
        line = r.get("gpu_busy_timeline") or []
        if line:
            ax.plot([t for t, _ in line], [b for _, b in line], color=RUN_COLOURS.get(r["name"], "#888"),
                    label=f"{r['name']}: mean {r['gpu_busy_pct']:.0f}%")
            drawn = True
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("GPU busy (%)")
    ax.set_title(title + ": GPU busy")
    if drawn:
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no GPU utilization reader on this device (n/a)", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    busy = out / FILES[1]
    fig.savefig(busy)
    plt.close(fig)
    return [stages, busy]
