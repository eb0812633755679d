"""The server's log lines about traffic: one access line per chat request and a periodic stats
line while serving (the shape of vLLM's "Avg prompt throughput ..." and FastDeploy's log dir).

Access line (INFO, logger ``fastdeploy_ext.access``), one per answered chat request, whatever
its outcome::

    request chatcmpl-1f.. status=200 prompt_tokens=117 output_tokens=12 ttft=0.041s e2e=0.093s finish=stop

Refusals before a request id exists (400 bad body, 404 unknown model, 429, ...) carry ``-`` as
id, 0 tokens and ``ttft=-``. Stats line (INFO, logger ``fastdeploy_ext.stats``) every
``--log-stats-interval`` seconds while the engine runs, skipped while idle and unchanged::

    stats: prompt 233.1 tok/s, generation 25.0 tok/s, finished 2 (0.2 req/s), running 1, waiting 0,
    preprocessing 0, KV 3.1% (2/64 blocks), GPU busy n/a

Throughputs are deltas of the engine's own token counters over the interval; GPU busy is the
backend's utilization reader (the vendor's management library on a GPU) sampled at the line,
``n/a`` where the backend has none (CPU)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

access_log = logging.getLogger("fastdeploy_ext.access")
stats_log = logging.getLogger("fastdeploy_ext.stats")

DEFAULT_STATS_INTERVAL_S = 10.0


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def log_access(rid: str | None, status: int, prompt_tokens: int = 0, output_tokens: int = 0,
               ttft_s: float | None = None, e2e_s: float | None = None, finish: str | None = None) -> None:
    access_log.info("request %s status=%d prompt_tokens=%d output_tokens=%d ttft=%s e2e=%s finish=%s",
                    rid or "-", status, prompt_tokens, output_tokens, _secs(ttft_s), _secs(e2e_s), finish or "-")


@dataclass
class _Snapshot:
    t: float
    prompt_tokens: int
    generation_tokens: int
    finished: int


def stats_line(prev: _Snapshot, now: _Snapshot, s: Any, gpu_busy_pct: float | None) -> str:
    dt = max(now.t - prev.t, 1e-9)
    done = now.finished - prev.finished
    used, total = s.kv_blocks_used, s.kv_blocks_total
    return (f"stats: prompt {(now.prompt_tokens - prev.prompt_tokens) / dt:.1f} tok/s, "
            f"generation {(now.generation_tokens - prev.generation_tokens) / dt:.1f} tok/s, "
            f"finished {done} ({done / dt:.1f} req/s), running {s.num_running}, waiting {s.num_waiting}, "
            f"preprocessing {s.num_preprocessing}, KV {100 * s.kv_usage:.1f}% ({used}/{total} blocks), "
            f"GPU busy {'n/a' if gpu_busy_pct is None else f'{gpu_busy_pct:.0f}%'}")


def _snapshot(s: Any) -> _Snapshot:
    return _Snapshot(time.monotonic(), s.prompt_tokens, s.generation_tokens, s.num_finished + s.num_aborted)


def utilization_reader(engine: Any) -> Callable[[], float] | None:
    """The backend's device-busy reader behind an AsyncLLMEngine, or None (CPU, or not exposed)."""
    runner = getattr(getattr(engine, "engine", None), "runner", None)
    reader = getattr(runner, "utilization_reader", None)
    try:
        return reader() if reader is not None else None
    except Exception:  # noqa: BLE001 - no reader is a normal answer (no management library): the line says n/a
        return None


async def stats_loop(stats_fn: Callable[[], Any], interval_s: float,
                     busy_fn: Callable[[], float] | None = None) -> None:
    """Logs a stats line every ``interval_s`` seconds until cancelled; ``stats_fn()`` returns the
    engine's stats or None (engine not started / stopped: nothing is logged)."""
    if interval_s <= 0:
        return
    prev, idle_logged = None, False
    while True:
        await asyncio.sleep(interval_s)
        try:
            s = stats_fn()
        except Exception:  # noqa: BLE001 - the engine died or stopped: the watchdog reports that
            s = None
        if s is None:
            continue
        now = _snapshot(s)
        if prev is None:      # the engine's counters start at 0 when it starts (one interval ago or less)
            prev = _Snapshot(now.t - interval_s, 0, 0, 0)
        active = (now.generation_tokens, now.prompt_tokens, now.finished) != \
            (prev.generation_tokens, prev.prompt_tokens, prev.finished) or s.num_running or s.num_waiting
        if active or not idle_logged:
            busy = None
            if busy_fn is not None:
                try:
                    busy = float(busy_fn())
                except Exception:  # noqa: BLE001 - a failed read is reported as n/a, not fatal
                    busy = None
            stats_log.info("%s", stats_line(prev, now, s, busy))
        idle_logged = not active
        prev = now
