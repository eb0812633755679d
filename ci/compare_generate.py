#!/usr/bin/env python3
"""Old vs new `bench generate --json-out` reports, several rounds of each: the median of every
figure per side and the new/old ratio, one line per figure (higher is better for rates, lower
for times). Used by ci/gpu_bench.sh's `compare` step.

    python3 ci/compare_generate.py old_1.json old_2.json -- new_1.json new_2.json
"""
from __future__ import annotations

import json
import statistics
import sys

# (workload, side key, figure, higher is better)
FIGURES = (("page1", "ttft_s", False), ("page1", "decode_tokens_per_s", True),
           ("pages64", "requests_per_s", True), ("lines256", "requests_per_s", True))


def figures(path: str) -> dict[str, float]:
    with open(path) as f:
        report = json.load(f)
    out = {}
    for wl, key, _ in FIGURES:
        ours = report.get("workloads", {}).get(wl, {}).get("ours", {})
        if key in ours:
            out[f"{wl}.{key}"] = float(ours[key])
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__)
        return 2
    cut = argv.index("--")
    sides = {"old": [figures(p) for p in argv[:cut]], "new": [figures(p) for p in argv[cut + 1:]]}
    if not sides["old"] or not sides["new"]:
        print("compare_generate: need at least one report on each side")
        return 2
    print(f"median of {len(sides['old'])} old / {len(sides['new'])} new rounds")
    print(f"{'figure':34s} {'old':>10s} {'new':>10s} {'new/old':>8s}  all old | all new")
    for wl, key, higher in FIGURES:
        name = f"{wl}.{key}"
        old = [r[name] for r in sides["old"] if name in r]
        new = [r[name] for r in sides["new"] if name in r]
        if not old or not new:
            continue
        mo, mn = statistics.median(old), statistics.median(new)
        better = "better" if (mn > mo) == higher else "worse"
        print(f"{name:34s} {mo:10.4g} {mn:10.4g} {mn / mo:8.3f}  ({better}) "
              f"{', '.join(f'{v:.4g}' for v in old)} | {', '.join(f'{v:.4g}' for v in new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
