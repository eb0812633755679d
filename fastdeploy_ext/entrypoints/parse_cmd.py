"""`fastdeploy-ext parse` and `fastdeploy-ext parse-status` (DESIGN.md section 5's forms; the
flags keep their names and meaning, more may be added).

Exit status of `parse`: 0 every page is done; 3 the run finished but some pages failed, are still
pending (a worker lost) or some inputs could not be opened: they are in errors.jsonl (rerun with --retry-failed to try them again); 2 a usage error
(bad flag value, missing input, a workspace made with other options), nothing parsed.
"""
from __future__ import annotations

import argparse
import logging
import time

from .args import (CliError, add_device_args, add_engine_args, add_model_args, add_plan_args,
                   engine_config_from_args, model_source_from_args, plan_request_from_args)

log = logging.getLogger("fastdeploy_ext")

#: `parse` finished, some pages failed (errors.jsonl says which and why)
EXIT_PAGES_FAILED = 3


def add_parse_options(p: argparse.ArgumentParser) -> None:
    """The document options `parse` and `bench parse` share."""
    g = p.add_argument_group("document parsing")
    g.add_argument("--layout-model", default=None, metavar="DIR",
                   help="layout detector dir (PP-DocLayoutV3, or V2); without it (or with --layout-load-format "
                        "dummy) random weights: boxes that mean nothing, for measuring only")
    g.add_argument("--layout-load-format", default="auto", choices=("auto", "dummy"))
    g.add_argument("--layout-family", default=None, metavar="NAME", help="the layout family (default: config.json's)")
    g.add_argument("--dpi", type=int, default=144, help="PDF render resolution (144 = PaddleX's zoom 2)")
    g.add_argument("--chart-recognition", action="store_true", help="charts to the VLM (else kept as images)")
    g.add_argument("--seal-recognition", action="store_true", help="seals to the VLM (else OCR)")
    g.add_argument("--max-pages-in-flight", type=int, default=16,
                   help="pages rendered and not yet written at once (bounds host memory)")
    g.add_argument("--max-new-tokens", type=int, default=4096, help="per block")
    g.add_argument("--render-workers", type=int, default=2, help="PDF rendering processes")
    g.add_argument("--layout-batch", type=int, default=8, help="most pages per layout model call")
    g.add_argument("--layout-threshold", type=float, default=0.3, help="layout score threshold (PaddleX's 0.3)")
    g.add_argument("--block-max-pixels", type=int, default=None,
                   help="cap each block crop's max_pixels below the task's 1003520 (small test models)")
    g.add_argument("--planted-layouts", default=None, metavar="FILE.json",
                   help="boxes per page from this file instead of the model's (the model still runs): "
                        "benchmarks and tests")
    g.add_argument("--stub-vlm", action="store_true", help="no VLM: every block's text is a stub (the CPU stages alone)")


def add_parse_commands(sub, command_parser) -> None:
    """The `parse` and `parse-status` subcommands (cli.build_parser calls this)."""
    p = command_parser(sub, "parse", "PDFs and page images -> Markdown + PaddleX-shaped JSON per page "
                                     "(resumable: a rerun on the same --output skips done pages)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="PDF / image files, folders (recursive), globs, or @list.txt (one path per line)")
    p.add_argument("--output", required=True, metavar="DIR", help="the workspace: outputs, manifest, errors.jsonl")
    p.add_argument("--formats", default="md,json", help="md, json or md,json")
    p.add_argument("--pages", default=None, metavar="R", help='1-based pages per document, e.g. "1-3,7" or "5-"')
    p.add_argument("--jsonl-shards", type=int, default=None, metavar="N",
                   help="one JSON line per page in N shards instead of per-page files (bulk runs)")
    p.add_argument("--visualize", action="store_true",
                   help="per page a PNG of its layout (<stem>_0001_layout.png: boxes, reading order, labels)")
    p.add_argument("--retry-failed", action="store_true", help="redo pages an earlier run recorded as failed")
    p.add_argument("--workers", type=int, default=1, help="engine processes on this host, fed from one manifest")
    p.add_argument("--gpus", default=None, metavar="0,1", help="CUDA devices of the workers, one per worker")
    p.add_argument("--lease-ttl", type=float, default=60.0, metavar="S",
                   help="--workers: a worker silent for S seconds loses its pages to the others")
    p.add_argument("--lease-pages", type=int, default=4, metavar="N", help="--workers: pages per lease")
    add_ray_args(p)
    p.add_argument("--json-progress", action="store_true",
                   help="one JSON progress line every few seconds on stdout instead of the bar")
    p.add_argument("--progress-interval", type=float, default=5.0, metavar="S", help=argparse.SUPPRESS)
    add_model_args(p)
    add_parse_options(p)
    add_device_args(p)
    add_plan_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_parse)

    s = command_parser(sub, "parse-status", "done / failed / pending pages of a parse --output DIR, and the rate")
    s.add_argument("output", metavar="DIR")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.set_defaults(func=cmd_parse_status)


#: `--ray` without an address: ray.init's own rule (RAY_ADDRESS, a cluster `ray start`ed on this host, else a
#: new local one)
RAY_DEFAULT_ADDRESS = "default"


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """`parse --ray`: the pipeline on a Ray cluster (the optional [ray] extra; parsing/ray_cluster.py)."""
    g = p.add_argument_group("cluster (Ray)")
    g.add_argument("--ray", nargs="?", const=RAY_DEFAULT_ADDRESS, default=None, metavar="ADDRESS",
                   help="run the workers as Ray actors: ADDRESS of the cluster (host:6379, ray://host:10001, auto), "
                        "or none for ray.init's default; --output must be on a path every node mounts")
    g.add_argument("--ray-gpus-per-worker", type=float, default=None, metavar="G",
                   help="--ray: GPUs per worker actor (default 1 where the cluster has GPUs, 0 with --device cpu)")
    g.add_argument("--ray-num-workers", default="auto", metavar="N|auto",
                   help="--ray: worker actors (auto: cluster GPUs / GPUs per worker, or one per node without GPUs)")
    g.add_argument("--ray-render", default="tasks", choices=("tasks", "actor"),
                   help="--ray: render pages as CPU tasks over the cluster, or in each worker's own processes")
    g.add_argument("--max-attempts", type=int, default=3, metavar="N",
                   help="--ray: a page whose worker was lost N times (killed, preempted, silent past --lease-ttl) "
                        "is recorded as failed instead of handed out again")


def ray_options_from_args(ns: argparse.Namespace):
    """The --ray flags -> RayOptions (a bad value is a CliError)."""
    import os

    from ..parsing.ray_cluster import RayOptions
    address = None if ns.ray == RAY_DEFAULT_ADDRESS else ns.ray
    if address is not None and os.path.exists(address):
        raise CliError(f"--ray took {address!r} (an input path) as the cluster address: put --ray after the inputs, "
                       "or write --ray=ADDRESS")
    n = ns.ray_num_workers
    try:
        workers = None if n == "auto" else int(n)
    except ValueError:
        raise CliError(f"--ray-num-workers {n!r}: a number or auto") from None
    opts = RayOptions(address=address, gpus_per_worker=ns.ray_gpus_per_worker, num_workers=workers,
                      max_attempts=ns.max_attempts, render=ns.ray_render)
    try:
        opts.validate()
    except ValueError as e:
        raise CliError(str(e)) from None
    return opts


def parse_options_from_args(ns: argparse.Namespace, *, output: str | None, default_dummy: bool = False):
    """The flags -> ParseOptions (a bad value is a CliError). ``default_dummy``: no
    --layout-model means random layout weights (benchmarks) instead of an error."""
    from ..parsing.parser import ParseOptions
    stub = getattr(ns, "stub_vlm", False)
    if ns.layout_model is None and ns.layout_load_format != "dummy" and not default_dummy:
        # DESIGN.md section 5 keeps --layout-model optional: without it the layout model has
        # random weights, which is only good for measuring; said loudly
        log.warning("parse: no --layout-model: the layout model has random weights (--layout-load-format dummy); "
                    "its boxes mean nothing. Pass --layout-model DIR (PP-DocLayoutV3) for real layouts")
    source = model_source_from_args(ns, default_dummy=stub)
    plan = plan_request_from_args(ns)
    engine = None if stub else engine_config_from_args(ns, source, plan)
    gpus = None
    if getattr(ns, "gpus", None):
        try:
            gpus = tuple(int(x) for x in ns.gpus.split(","))
        except ValueError:
            raise CliError(f"--gpus {ns.gpus!r}: a comma-separated list of device indices, e.g. 0,1") from None
    formats = frozenset(f.strip() for f in getattr(ns, "formats", "md,json").split(",") if f.strip())
    workers = getattr(ns, "workers", 1)
    if gpus is not None and workers == 1 and len(gpus) > 1:
        workers = len(gpus)
    try:
        opts = ParseOptions(model=source.model_dir, load_format=source.load_format, model_format=source.model_format,
                            model_family=source.model_family, layout_model=ns.layout_model,
                            layout_load_format=ns.layout_load_format, layout_family=ns.layout_family,
                            device=ns.device, dtype=ns.dtype, output=output, formats=formats,
                            pages=getattr(ns, "pages", None), dpi=ns.dpi, chart_recognition=ns.chart_recognition,
                            seal_recognition=ns.seal_recognition, jsonl_shards=getattr(ns, "jsonl_shards", None),
                            max_pages_in_flight=ns.max_pages_in_flight, max_new_tokens=ns.max_new_tokens,
                            retry_failed=getattr(ns, "retry_failed", False), workers=workers, gpus=gpus,
                            render_workers=ns.render_workers, layout_batch=ns.layout_batch,
                            layout_threshold=ns.layout_threshold, block_max_pixels=ns.block_max_pixels,
                            planted_layouts=ns.planted_layouts, stub_vlm=stub, visualize=getattr(ns, "visualize", False),
                            lease_ttl_s=getattr(ns, "lease_ttl", 60.0), lease_pages=getattr(ns, "lease_pages", 4),
                            engine=engine)
        opts.validate()
        if opts.layout_model is not None and opts.layout_load_format != "dummy":
            import os
            if not os.path.isdir(opts.layout_model):
                raise ValueError(f"--layout-model {opts.layout_model}: not a directory")
    except ValueError as e:
        raise CliError(str(e)) from None
    return opts


def cmd_parse(args) -> int:
    from ..parsing.errors import PageError
    from ..parsing.parser import DocumentParser
    from ..parsing.progress import Progress
    from ..parsing.workspace import WorkspaceLocked
    opts = parse_options_from_args(args, output=args.output)
    t0 = time.perf_counter()
    parser = DocumentParser(opts) if args.ray is None else _ray_parser(opts, args)
    progress: list[Progress] = []

    def start(total: int) -> None:
        progress.append(Progress(total, json_lines=args.json_progress, interval_s=args.progress_interval,
                                 gpu_reader=lambda: _gpu_busy(parser)))
    try:
        for outcome in parser.parse(args.inputs, on_start=start):
            progress[0].update(outcome)
    except PageError as e:
        raise CliError(str(e)) from None
    except WorkspaceLocked as e:                      # another parse holds this --output
        raise CliError(str(e)) from None
    except (ValueError, FileNotFoundError) as e:      # bad inputs, a workspace of other options: nothing parsed
        raise CliError(str(e)) from None
    finally:
        for p in progress:
            p.close()
        parser.close()
    st = parser.workspace_status
    log.info("parse: %d pages done, %d failed, %d pending, %d inputs unreadable after %.1f s -> %s", st.done,
             st.failed, st.pending, st.input_errors, time.perf_counter() - t0, args.output)
    if st.failed or st.pending or st.input_errors:
        log.warning("parse: %d pages not done, %d inputs unreadable (see %s/errors.jsonl; `fastdeploy-ext "
                    "parse-status %s`; rerun with --retry-failed to redo failed pages): exit status %d",
                    st.failed + st.pending, st.input_errors, args.output, args.output, EXIT_PAGES_FAILED)
        return EXIT_PAGES_FAILED
    return 0


def _ray_parser(opts, args):
    try:
        from ..parsing.ray_cluster import RayDocumentParser
        import ray  # noqa: F401
    except ImportError:
        raise CliError("--ray needs Ray: pip install 'fastdeploy-ext[ray]' (ray==2.60.0)") from None
    if opts.workers > 1 or opts.gpus:
        raise CliError("--ray places one worker per device itself: drop --workers/--gpus (use --ray-num-workers)")
    try:
        return RayDocumentParser(opts, ray_options_from_args(args))
    except ValueError as e:
        raise CliError(str(e)) from None


def _gpu_busy(parser):
    read = parser.gpu_reader
    return read() if read is not None else None


def cmd_parse_status(args) -> int:
    from ..parsing.status import format_status, workspace_status
    try:
        st = workspace_status(args.output)
    except (OSError, ValueError) as e:
        raise CliError(f"{args.output}: {e}") from None
    print(format_status(st, as_json=args.json))
    return 0
