"""`parse --ray [ADDRESS]`: the parse pipeline on a Ray cluster, exactly once.

The driver (the `parse` process) is the coordinator, as with ``--workers``: it opens the
workspace on the shared path (the manifest, the done log and the outputs; it is their only
writer) and holds the lease table. Ray places one ``ParseWorker`` actor per device
(ray_worker.py: the engine, the layout model and the one-machine pipeline) and the render tasks;
it schedules, it does not decide what is done: every page's outcome comes back to the driver and
is committed under its lease's fencing token, or refused.

- Work goes out in leases of ``--lease-pages`` pages, one lease when an actor's pipeline asks for
  pages and at most pages-in-flight / lease-pages leases per actor (backpressure: an actor never
  holds more than it can run).
- Each actor has one ``take`` call outstanding; its answer (results, "want", the device's busy %)
  or its timeout (a third of ``--lease-ttl``) renews the actor's leases. The driver waits on all of
  them at once (``ray.wait``) with the next lease expiry as its timeout, never a poll.
- An actor that dies (kill -9, a lost or preempted node) fails its outstanding call: its leases end
  at once and their pages go to the front of the queue; a replacement actor is started while
  pages remain. An actor that hangs lets its leases expire; if it wakes up, its results fail the
  token check and are dropped. A page granted more than ``--max-attempts`` times (every worker
  holding it was lost) is recorded as failed (errors.jsonl, stage "worker") instead of killing
  workers forever.
- The driver dying kills its actors (they are owned by its job) and leaves the workspace as a
  kill -9 of one process does: a rerun resumes it.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .pipeline import PageOutcome

log = logging.getLogger(__name__)

#: an actor that has not loaded its models by then (placement included) is given up
ACTOR_START_TIMEOUT_S = 600.0
#: the actor's concurrent calls: take (blocking), feed, info and stop beside its pipeline thread
ACTOR_CONCURRENCY = 4
RENDER_MODES = ("tasks", "actor")


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """ValueError unless ``address`` (HOST:PORT or ray://HOST:PORT) accepts a TCP connection
    within ``timeout_s``: ray.init retries an address where nothing answers for minutes, so a
    mistyped head address would look like a hang."""
    import socket
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ray {address}: not a HOST:PORT address (the head's GCS port, e.g. 10.0.0.5:6379)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(f"--ray {address}: nothing answers there ({type(e).__name__}: {e}); is the head running "
                         "(`ray start --head` on it) and the port open from this host?") from None


@dataclass(frozen=True)
class RayOptions:
    """The --ray flags. ``address`` None: ray.init's own rule (RAY_ADDRESS, a cluster started on
    this host with `ray start`, else a new local one)."""
    address: str | None = None
    gpus_per_worker: float | None = None       # None: 1 where the cluster has GPUs and the device is not the CPU
    num_workers: int | None = None             # None: auto (one per gpus_per_worker GPUs, or one per node)
    max_attempts: int = 3
    render: str = "tasks"                      # render tasks over the cluster, or in each actor's processes

    def validate(self) -> None:
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--ray-gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"--ray-num-workers must be >= 1 or auto, got {self.num_workers}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.render not in RENDER_MODES:
            raise ValueError(f"--ray-render must be one of {RENDER_MODES}, got {self.render!r}")


@dataclass(frozen=True)
class Decision:
    value: object
    reason: str


def plan_workers(ray_opts: RayOptions, device: str, resources: dict, nodes: int) -> tuple[Decision, Decision]:
    """(GPUs per actor, number of actors) for the cluster's total ``resources``, each with why."""
    gpus = float(resources.get("GPU", 0))
    if ray_opts.gpus_per_worker is not None:
        per = Decision(ray_opts.gpus_per_worker, "--ray-gpus-per-worker")
    elif device == "cpu":
        per = Decision(0.0, "--device cpu")
    elif gpus > 0:
        per = Decision(1.0, f"the cluster has {gpus:g} GPUs: one per worker")
    else:
        per = Decision(0.0, "the cluster has no GPUs: CPU workers")
    if per.value > gpus:
        raise ValueError(f"--ray: each worker needs {per.value:g} GPUs ({per.reason}) but the cluster has "
                         f"{gpus:g}; start the workers' nodes with GPUs (`ray start --address ... --num-gpus N`) "
                         "or pass --ray-gpus-per-worker 0 --device cpu")
    if ray_opts.num_workers is not None:
        n = Decision(ray_opts.num_workers, "--ray-num-workers")
    elif per.value > 0:
        n = Decision(max(1, int(gpus // per.value)), f"auto: {gpus:g} GPUs / {per.value:g} per worker")
    else:
        n = Decision(max(1, nodes), f"auto: one CPU worker per node ({nodes} nodes)")
    return per, n


def plan_render(mode: str, resources: dict, workers: int) -> Decision:
    """Where pages are rendered: Ray tasks unless the actors (one CPU each) leave the cluster no CPU
    for them, where the tasks would wait forever and each actor renders in its own processes."""
    if mode == "actor":
        return Decision("actor", "--ray-render actor: each worker's own render processes")
    spare = float(resources.get("CPU", 0)) - workers
    if spare < 1:
        return Decision("actor", f"the workers take {workers} of the cluster's {resources.get('CPU', 0):g} CPUs, "
                                 "none is left for render tasks: each worker renders in its own processes")
    return Decision("tasks", f"Ray tasks over the cluster ({spare:g} CPUs beside the workers)")


@dataclass
class _Actor:
    index: int
    generation: int
    handle: object
    name: str
    ready: bool = False
    done: bool = False             # lost or released: no more calls
    info: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    # this run's
    waiting: bool = False          # its pipeline asked for pages and got none yet
    first_round: bool = False      # one of the actors this run started with (work waits for all of them)
    first_lease: float | None = None
    last_commit: float | None = None
    pages: int = 0
    busy: list = field(default_factory=list)

    def new_run(self) -> None:
        self.waiting, self.first_round = False, True
        self.first_lease = self.last_commit = None
        self.pages, self.busy = 0, []


class RayDocumentParser:
    """What cmd_parse drives for `parse --ray` (DocumentParser's face: ``parse``,
    ``workspace_status``, ``gpu_reader``, ``close``). The worker actors (and their loaded models)
    outlive a ``parse`` call and serve the next one; ``close`` releases them."""

    def __init__(self, opts, ray_opts: RayOptions):
        opts.validate()
        ray_opts.validate()
        if opts.output is None:
            raise ValueError("--ray needs --output DIR on a path every node mounts: the workers share its manifest")
        self.options, self.ray_options = opts, ray_opts
        self.workspace_status = None
        self.pages_total = 0
        self.actors: list[_Actor] = []
        self._gpu_busy: dict[str, float] = {}
        self._started_ray = False
        self._table = None
        self._calls: dict = {}           # ObjectRef -> (actor, "info" | "take"): one outstanding per live actor
        self._run_id = 0
        self._actor_cls = None
        self._render = ray_opts.render

    @property
    def gpu_reader(self) -> Callable[[], float | None]:
        return lambda: (sum(self._gpu_busy.values()) / len(self._gpu_busy)) if self._gpu_busy else None

    def _connect(self):
        import ray
        if ray.is_initialized():                   # the caller's own session (tests, notebooks)
            return ray
        addr = self.ray_options.address
        kwargs = {"address": addr} if addr not in (None, "local") else {}
        if addr not in (None, "local", "auto"):
            check_reachable(addr)
        try:
            ray.init(**kwargs, log_to_driver=True, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as e:      # no cluster there: a usage error, not a traceback
            raise ValueError(f"--ray {addr or ''}: cannot reach a Ray cluster ({type(e).__name__}: {e}); start one "
                             "with `ray start --head` or give its address (HEAD:6379)") from None
        self._started_ray = True
        return ray

    def _start_actor(self, ray, index: int, generation: int, per_worker_gpus: float) -> _Actor:
        if self._actor_cls is None:
            from .ray_worker import ParseWorker
            self._actor_cls = ray.remote(ParseWorker).options(
                num_cpus=1, num_gpus=per_worker_gpus, max_concurrency=ACTOR_CONCURRENCY, max_restarts=0)
        name = f"ray-{index}" if generation == 0 else f"ray-{index}.{generation}"
        level = logging.getLogger().getEffectiveLevel()
        a = _Actor(index, generation, self._actor_cls.remote(name, self.options, self._render, level), name)
        a.new_run()
        a.handle.begin.remote(self._run_id)
        self.actors.append(a)
        self._calls[a.handle.info.remote()] = (a, "info")
        return a

    def parse(self, inputs, *, on_start: Callable[[int], None] | None = None) -> Iterator[PageOutcome]:
        from .coordinator import lease_works, open_workspace
        from .leases import StaleLease
        from .workers import _settle
        opts, ropts = self.options, self.ray_options
        inputs = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
        ray = self._connect()
        resources = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        per, count = plan_workers(ropts, opts.device, resources, nodes)
        render = plan_render(ropts.render, resources, count.value)
        self._render = render.value
        log.info("parse --ray: cluster %s (%d nodes, %g CPUs, %g GPUs); %d workers (%s), %g GPUs each (%s); "
                 "rendering: %s", ray.get_runtime_context().gcs_address, nodes, resources.get("CPU", 0),
                 resources.get("GPU", 0), count.value, count.reason, per.value, per.reason, render.reason)
        ws, todo = open_workspace(opts, inputs)
        table = self._table = ws.leases
        self.pages_total = todo
        if on_start is not None:
            on_start(todo)
        log.info("parse --ray: %d pages to do in %s", todo, opts.output)
        self._run_id += 1
        run = self._run_id
        calls = self._calls
        cap = max(1, math.ceil(opts.max_pages_in_flight / opts.lease_pages))     # leases an actor may hold
        heartbeat = min(opts.lease_ttl_s / 3, 5.0)
        replacements_left = count.value * ropts.max_attempts

        def release_leases(a: _Actor) -> None:
            # a lost actor's pages go back now, not at their expiry: its leases renewed to end now
            for lease in table.active:
                if lease.worker == a.name:
                    try:
                        table.renew(lease, ttl_s=0.0)
                    except StaleLease:
                        pass
            for lease in table.expire():
                log.warning("parse --ray: lease %d of %s ended (%d pages, attempt %d): its pages go to another "
                            "worker", lease.lease_id, lease.worker, len(lease.keys), lease.attempt)

        def lost(a: _Actor, why: str) -> None:
            nonlocal replacements_left
            a.done = True
            release_leases(a)
            log.error("parse --ray: %s (pid %s on %s) lost: %s", a.name, a.info.get("pid", "?"),
                      a.info.get("node", "?"), why)
            try:
                ray.kill(a.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
            if todo > 0 and replacements_left > 0:
                replacements_left -= 1
                b = self._start_actor(ray, a.index, a.generation + 1, per.value)
                b.first_round = False
                log.warning("parse --ray: starting %s in its place (%d replacements left)", b.name, replacements_left)

        try:
            if todo > 0:                       # nothing to do: no actor started
                live = [a for a in self.actors if not a.done]
                for a in live:                 # the last run's actors, models loaded: a new pipeline each
                    a.new_run()
                    a.handle.begin.remote(run)
                used = {a.index for a in live}
                free = (i for i in range(len(self.actors) + count.value) if i not in used)
                for _ in range(count.value - len(live)):
                    self._start_actor(ray, next(free), 0, per.value)
            while todo > 0:
                live = [a for a in self.actors if not a.done]
                if not live:
                    log.error("parse --ray: no worker left (replacements used up); %d pages stay pending for a rerun",
                              todo)
                    break
                nxt = min((lease.expires_at for lease in table.active), default=None)
                timeout = None if nxt is None else max(nxt - table.clock(), 0.0)
                unready = [a for a in live if not a.ready]
                if unready:
                    left = min(ACTOR_START_TIMEOUT_S - (time.monotonic() - a.started) for a in unready)
                    if left <= 0:
                        raise RuntimeError(f"parse --ray: worker {unready[0].name} did not start within "
                                           f"{ACTOR_START_TIMEOUT_S:g} s (not placed: see `ray status`; or its model "
                                           "load hangs: see its log lines)")
                    timeout = left if timeout is None else min(timeout, left)
                ready, _ = ray.wait(list(calls), num_returns=1, timeout=timeout)
                if ready:
                    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
                for lease in table.expire():
                    log.warning("parse --ray: lease %d of %s expired (token %d, %d pages, attempt %d): its pages go "
                                "to another worker", lease.lease_id, lease.worker, lease.token, len(lease.keys),
                                lease.attempt)
                for ref in ready:
                    a, kind = calls.pop(ref)
                    if a.done:
                        continue
                    try:
                        value = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - RayActorError (died, node lost) or its __init__ raised
                        lost(a, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                        continue
                    if kind == "info":
                        a.ready, a.info = True, value
                        log.info("parse --ray: %s up (pid %d on node %s, GPUs %s, %s) after %.1f s", a.name,
                                 value["pid"], value["node"], value["gpus"] or "none", value["device"],
                                 time.monotonic() - a.started)
                    elif value["run"] == run:
                        for lease in table.active:          # the answer is the actor's heartbeat
                            if lease.worker == a.name:
                                try:
                                    table.renew(lease)
                                except StaleLease:
                                    pass
                        for msg in value["results"]:
                            outcome = _settle(ws, table, msg)
                            if outcome is not None:      # settled once (the fencing token): one page less
                                todo -= 1
                                a.pages += 1
                                a.last_commit = time.monotonic()
                                yield outcome
                        if value["busy"] is not None:
                            a.busy.append(value["busy"])
                            self._gpu_busy[a.name] = value["busy"]
                        if value["want"]:
                            a.waiting = True
                        if value["error"] is not None or value["finished"]:
                            lost(a, f"its pipeline ended: {value['error'] or 'finished early'}")
                            continue
                    calls[a.handle.take.remote(run, heartbeat)] = (a, "take")
                # work goes out once every actor this run started with is up (the first one
                # ready would otherwise take everything)
                if any(a.first_round and not a.ready and not a.done for a in self.actors):
                    continue
                held: dict[str, int] = {}
                for lease in table.active:
                    held[lease.worker] = held.get(lease.worker, 0) + 1
                for a in self.actors:
                    while a.waiting and a.ready and not a.done and held.get(a.name, 0) < cap and todo > 0:
                        lease = ws.grant(a.name, opts.lease_pages, opts.lease_ttl_s, retry_failed=opts.retry_failed)
                        if lease is None:
                            break
                        works = []
                        for work in lease_works(ws, lease):
                            if table.attempts(work.key) > ropts.max_attempts:
                                msg = (f"gave up after {ropts.max_attempts} attempts: every worker that held the page "
                                       "was lost (killed, preempted, or silent past --lease-ttl)")
                                outcome = _settle(ws, table, ("fail", lease, work, "worker", msg))
                                if outcome is not None:
                                    todo -= 1
                                    log.error("parse --ray: %s page %d: %s", work.path, work.page_index + 1, msg)
                                    yield outcome
                            else:
                                works.append(work)
                        if not works:
                            continue
                        a.handle.feed.remote(run, lease, works)
                        a.waiting = False
                        a.first_lease = a.first_lease or time.monotonic()
                        held[a.name] = held.get(a.name, 0) + 1
                        log.info("parse --ray: lease %d (token %d, attempt %d, %d pages) -> %s", lease.lease_id,
                                 lease.token, lease.attempt, len(works), a.name)
            if todo <= 0:
                log.info("parse --ray: every page settled")
        finally:
            for a in self.actors:
                if not a.done:
                    try:
                        a.handle.stop.remote()     # the pipeline ends; the actor and its models stay for the next run
                    except Exception:  # noqa: BLE001 - gone
                        pass
            self.workspace_status = ws.status()
            self._table = None
            ws.close()
            self._log_summary()

    def _log_summary(self) -> None:
        for a in self.actors:
            if a.first_lease is None:
                continue
            span = max((a.last_commit or a.first_lease) - a.first_lease, 1e-9)
            busy = f", GPU busy {sum(a.busy) / len(a.busy):.0f} %" if a.busy else ""
            log.info("parse --ray: %s (pid %s on %s): %d pages in %.1f s, %.2f pages/s%s", a.name,
                     a.info.get("pid", "?"), a.info.get("node", "?"), a.pages, span, a.pages / span if a.pages else 0.0,
                     busy)

    def leases_held(self) -> dict[str, int]:
        """Worker name -> pages it holds under current leases (tests pick a worker to kill by it)."""
        held: dict[str, int] = {}
        for lease in self._table.active if self._table is not None else ():
            held[lease.worker] = held.get(lease.worker, 0) + len(lease.keys)
        return held

    def close(self) -> None:
        """Release the worker actors (and the Ray session this parser started)."""
        if self.actors:
            import ray
            for a in self.actors:
                if not a.done:
                    a.done = True
                    try:
                        ray.kill(a.handle)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            self._calls.clear()
        if self._started_ray:
            import ray
            ray.shutdown()
            self._started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
