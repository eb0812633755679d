"""The host CPU: /proc/cpuinfo flags and oneDNN's evidence that AMX kernels actually run.

``probe_cpu(cpuinfo_text=None, cpuinfo_path=None)``
    Flags and model from the cpuinfo file (``FD_CPUINFO``, default /proc/cpuinfo) or the given
    text; py-cpuinfo's ``get_cpu_info()['flags']`` when the file cannot be read (e.g. macOS).
    ``has_amx`` = ``amx_tile`` and ``amx_bf16`` in the flags. Also torch's view:
    ``torch.backends.cpu.get_cpu_capability()`` (torch 2.13: DEFAULT, VSX, "Z VECTOR", "NO AVX",
    AVX2, AVX512, SVE256 — no "AMX" value, so it cannot tell AMX from plain AVX-512) and
    ``torch.backends.mkldnn.is_available()``.

``probe_cpu_amx()``
    ``probe_cpu()`` plus, when the flags say AMX, the proof that it is used: oneDNN's verbose
    output from the encoder's OWN matmuls (bf16 Linear layers of :func:`encoder_matmul_shapes`:
    [tokens, 1152] x [1152 -> 3456 / 1152 / 4304], [tokens, 4304] x [4304 -> 1152], the patch
    embedding and the projector), run once per process and per ``ONEDNN_MAX_CPU_ISA`` value
    (:func:`amx_evidence_for_encoder`). ``details["amx_proven"]`` is true only when every one of
    those matmuls executed on an AMX kernel; the ``cpu_amx`` row requires it
    (``match: {onednn_amx: true}``), so flags with oneDNN capped below AMX
    (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``), a kernel that does not enable AMX, or an
    AVX2-only CPU all get the ``cpu`` row, with the reason in the plan.

``onednn_amx_evidence(timeout_s=120, max_cpu_isa=None, shapes=None)``
    The subprocess behind it (``ONEDNN_VERBOSE=1``); :func:`parse_onednn_verbose` reads the
    verbose lines. The oneDNN ISA banner is only the CPU's ceiling: only *executed* primitives
    count (e.g. ``brg_matmul:avx512_core_amx``), per problem ("MxK:KxN" -> implementation).
    ``ONEDNN_MAX_CPU_ISA`` in the environment passes through; ``max_cpu_isa`` sets it for the
    subprocess only. Never raises.
"""
# Probes must never raise, whatever a library throws: blind excepts are the point here.
# ruff: noqa: BLE001, S110
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from fastdeploy_ext import envs
from fastdeploy_ext.platforms import DeviceInfo, ProbeResult, error_text, import_quietly

__all__ = ["AmxEvidence", "amx_evidence_for_encoder", "cpu_family", "encoder_matmul_shapes", "onednn_amx_evidence",
           "parse_cpuinfo", "parse_onednn_verbose", "probe_cpu", "probe_cpu_amx"]


def cpu_family(flags) -> str:
    """By the flags alone: "cpu_amx" when amx_tile and amx_bf16 are present (necessary, not
    sufficient: the row also needs oneDNN's evidence), else "cpu"."""
    return "cpu_amx" if {"amx_tile", "amx_bf16"} <= set(flags) else "cpu"


@dataclass(frozen=True)
class AmxEvidence:
    amx_used: bool                 # an executed oneDNN primitive ran an AMX implementation
    isa: str                       # oneDNN's ISA banner (the CPU ceiling it detected), "" if none
    kernels: list[str] = field(default_factory=list)   # distinct implementation names executed
    raw_excerpt: str = ""          # a few verbose lines (ISA + first executions)
    reason: str = ""
    compute_primitives: int = 0    # executed matmul / inner_product / convolution / deconvolution
    amx_primitives: int = 0        # ... of which ran an AMX implementation
    max_cpu_isa: str | None = None  # ONEDNN_MAX_CPU_ISA the subprocess ran under, if any
    problems: dict = field(default_factory=dict)   # executed compute problem ("MxK:KxN") -> implementation

    def to_dict(self) -> dict:
        return {"amx_used": self.amx_used, "isa": self.isa, "kernels": list(self.kernels),
                "raw_excerpt": self.raw_excerpt, "reason": self.reason,
                "compute_primitives": self.compute_primitives, "amx_primitives": self.amx_primitives,
                "max_cpu_isa": self.max_cpu_isa, "problems": dict(self.problems)}

    def non_amx(self, shapes) -> list[str]:
        """The (m, k, n) matmuls of ``shapes`` that did not execute on an AMX kernel, as
        "MxK:KxN -> implementation" (or "-> not executed by oneDNN")."""
        out = []
        for m, k, n in shapes:
            key = f"{m}x{k}:{k}x{n}"
            impl = self.problems.get(key)
            if impl is None or not _is_amx_impl(impl):
                out.append(f"{key} -> {impl or 'not executed by oneDNN'}")
        return out


_CPU_FLAGS_OF_INTEREST = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_bf16", "avx512_fp16",
                          "avx512f", "avx512_vnni", "avx2")


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo text -> {"flags": sorted list, "model_name": str|None, "logical_cpus": int,
    "physical_cores": int|None}. Flags come from the first ``flags`` (x86) / ``Features`` (arm)."""
    flags: list[str] | None = None
    model = None
    processors = 0
    cores: set[tuple[str, str]] = set()
    phys = core = None
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if not sep:
            continue
        key, val = key.strip().lower(), val.strip()
        if key == "processor":
            processors += 1
            phys = core = None
        elif key in ("flags", "features") and flags is None:
            flags = val.split()
        elif key == "model name" and model is None:
            model = val
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
        if phys is not None and core is not None:
            cores.add((phys, core))
            phys = core = None
    return {"flags": sorted(set(flags or ())), "model_name": model, "logical_cpus": processors or None,
            "physical_cores": len(cores) or None}


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except Exception:
        pass
    return None


def probe_cpu(cpuinfo_text: str | None = None, cpuinfo_path: str | None = None) -> ProbeResult:
    """The host CPU: flags (AMX...), model, cores, and torch's CPU view. ``cpuinfo_text``: parse
    this /proc/cpuinfo text instead of reading ``cpuinfo_path`` (default: ``FD_CPUINFO``, which
    defaults to /proc/cpuinfo). No oneDNN evidence: that is :func:`probe_cpu_amx`."""
    if cpuinfo_path is None:
        cpuinfo_path = envs.FD_CPUINFO.get()
    try:
        return _probe_cpu(cpuinfo_text, cpuinfo_path)
    except Exception as e:
        return ProbeResult("cpu", True, True, f"CPU probe failed ({error_text(e)}); assuming a plain CPU",
                           (DeviceInfo(0, "cpu", None, None, "cpu"),))


def _probe_cpu(cpuinfo_text: str | None, cpuinfo_path: str) -> ProbeResult:
    notes: list[str] = []
    given = cpuinfo_text is not None
    source = "given text" if given else "none"
    mem = None
    if cpuinfo_text is None:
        try:
            with open(cpuinfo_path) as f:
                cpuinfo_text = f.read()
            source = cpuinfo_path
            mem = _mem_total_bytes()
        except Exception as e:
            notes.append(f"{cpuinfo_path} unreadable ({error_text(e)})")
    parsed = parse_cpuinfo(cpuinfo_text) if cpuinfo_text is not None else {
        "flags": [], "model_name": None, "logical_cpus": None, "physical_cores": None}
    if not parsed["flags"] and not given:
        try:
            info = import_quietly("cpuinfo").get_cpu_info()
            parsed["flags"] = sorted(set(info.get("flags") or ()))
            parsed["model_name"] = parsed["model_name"] or info.get("brand_raw")
            source = "py-cpuinfo"
        except Exception as e:
            notes.append(f"py-cpuinfo failed ({error_text(e)})")
    flags = parsed["flags"]
    model = parsed["model_name"]
    if not model:
        import platform
        model = platform.processor() or platform.machine() or "unknown CPU"

    details: dict = {"flags_source": source if flags else "none", "flags": flags, "model_name": model,
                     "os_cpu_count": os.cpu_count(), "logical_cpus": parsed["logical_cpus"],
                     "physical_cores": parsed["physical_cores"]}
    try:
        details["affinity_cpus"] = len(os.sched_getaffinity(0))
    except Exception:
        details["affinity_cpus"] = None
    fl = set(flags)
    for f in _CPU_FLAGS_OF_INTEREST:
        details[f] = f in fl
    has_amx = {"amx_tile", "amx_bf16"} <= fl
    details["has_amx"] = has_amx
    try:
        torch = import_quietly("torch")
        details["torch_num_threads"] = int(torch.get_num_threads())
        details["torch_cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
        details["mkldnn_available"] = bool(torch.backends.mkldnn.is_available())
    except Exception as e:
        details.update(torch_num_threads=None, torch_cpu_capability=None, mkldnn_available=False)
        notes.append(f"torch's CPU view unavailable ({error_text(e)})")

    family = cpu_family(fl)
    dev = DeviceInfo(0, model, mem, None, family)
    if not flags:
        isa = "CPU flags unknown"
    elif has_amx:
        amx = "+".join(f for f in ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16") if f in fl)
        isa = f"AMX ({amx})"
    else:
        missing = "/".join(f for f in ("amx_tile", "amx_bf16") if f not in fl)
        simd = "AVX-512" if "avx512f" in fl else ("AVX2" if "avx2" in fl else "no AVX-512/AVX2")
        isa = f"no AMX ({missing} missing), {simd}" + (", avx512_bf16" if "avx512_bf16" in fl else "")
    cores = details["affinity_cpus"] or details["os_cpu_count"]
    torch_txt = (f"torch capability {details['torch_cpu_capability']}, oneDNN "
                 f"{'available' if details['mkldnn_available'] else 'unavailable'}, "
                 f"{details['torch_num_threads']} threads") if details.get("torch_cpu_capability") else "torch n/a"
    reason = f"{model} [{family}], {cores} CPUs: {isa}; {torch_txt}"
    if notes:
        reason += "; " + "; ".join(notes)
    return ProbeResult("cpu", True, True, reason, (dev,), None, details, notes=tuple(notes))


_VERBOSE_MARKERS = ("onednn_verbose", "dnnl_verbose")
_COMPUTE_PRIMITIVES = frozenset({"matmul", "inner_product", "convolution", "deconvolution", "brgemm"})


def _is_amx_impl(impl: str) -> bool:
    return "amx" in impl.lower()


def parse_onednn_verbose(text: str) -> AmxEvidence:
    """Parse ONEDNN_VERBOSE / DNNL_VERBOSE output (oneDNN 2.x and 3.x formats, with or without
    the ``v1`` and timestamp fields). Only ``exec`` lines of primitives count as evidence; the
    ``isa:`` banner is reported but is only the CPU's ceiling."""
    isa = ""
    isa_line = ""
    kernels: list[str] = []
    compute_lines: list[str] = []
    other_lines: list[str] = []
    compute = amx = 0
    problems: dict[str, str] = {}
    for raw in text.splitlines():
        pos = min((raw.find(m) for m in _VERBOSE_MARKERS if m in raw), default=-1)
        if pos < 0:
            continue
        line = raw[pos:].strip()
        tokens = line.split(",")
        if not isa and "isa:" in line and "info" in tokens[:4]:
            isa = line[line.index("isa:") + 4:].strip()
            isa_line = line
            continue
        head = tokens[:5]
        if "exec" not in head or "graph" in head:
            continue
        i = head.index("exec")
        if len(tokens) < i + 4:
            continue
        _engine, prim, impl = tokens[i + 1], tokens[i + 2], tokens[i + 3].strip()
        if not impl:
            continue
        if impl not in kernels:
            kernels.append(impl)
        if prim in _COMPUTE_PRIMITIVES:
            compute += 1
            if len(tokens) >= 2:
                problems[tokens[-2].strip()] = impl       # problem_desc precedes exec_time
            if _is_amx_impl(impl):
                amx += 1
        (compute_lines if prim in _COMPUTE_PRIMITIVES else other_lines).append(
            line if len(line) <= 300 else line[:297] + "...")
    amx_used = any(_is_amx_impl(k) for k in kernels)
    isa_has_amx = "amx" in isa.lower()
    if amx_used:
        reason = (f"oneDNN executed AMX kernels ({', '.join(k for k in kernels if _is_amx_impl(k))}); "
                  f"{amx} of {compute} compute primitives ran on AMX")
    elif not isa and not kernels:
        reason = ("no oneDNN verbose output: nothing was dispatched to oneDNN (torch without oneDNN, or "
                  "oneDNN's ISA, possibly capped by ONEDNN_MAX_CPU_ISA, lacks the bf16 support torch requires)")
    elif isa_has_amx:
        reason = (f"oneDNN's ISA ceiling includes AMX but none of {compute} executed compute primitives "
                  f"used an AMX kernel (executed: {', '.join(kernels) or 'none'})")
    else:
        reason = (f"oneDNN ISA is {isa or 'unknown'!r} (no AMX); {compute} compute primitives, none on AMX; "
                  f"executed kernels: {', '.join(kernels) or 'none'}")
    shown = compute_lines[:5] + other_lines[:max(0, 5 - len(compute_lines))]
    excerpt = "\n".join(([isa_line] if isa_line else []) + shown)
    return AmxEvidence(amx_used, isa, kernels, excerpt, reason, compute, amx, problems=problems)


# The child runs each (m, k, n) as the encoder's Linear layers do: bf16 F.linear with a bias
# (torch sends bf16 CPU GEMMs to oneDNN's matmul when it can).
_AMX_CHILD = r"""
import json, sys
import torch, torch.nn.functional as F
print("fdx: torch", torch.__version__, "mkldnn", torch.backends.mkldnn.is_available(), flush=True)
torch.manual_seed(0)
for m, k, n in json.loads(sys.argv[1]):
    F.linear(torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16),
             torch.randn(n).to(torch.bfloat16))
print("fdx: done", flush=True)
"""

# a small page's worth of tokens: large enough that oneDNN picks its GEMM kernels, not a GEMV
EVIDENCE_TOKENS = 256


def encoder_matmul_shapes(tokens: int = EVIDENCE_TOKENS, cfg=None) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) of every GEMM of the default model family's vision encoder (its built-in config
    unless ``cfg`` is given), as the family declares them (ModelFamily.encoder_matmul_shapes)."""
    from fastdeploy_ext.models.registry import DEFAULT_FAMILY, get_family
    family = get_family(DEFAULT_FAMILY)
    return family.encoder_matmul_shapes(cfg or family.default_config(), tokens)


def onednn_amx_evidence(timeout_s: float = 120, max_cpu_isa: str | None = None,
                        shapes=None) -> AmxEvidence:
    """Run bf16 Linear layers of the given (m, k, n) shapes (default: the encoder's own,
    :func:`encoder_matmul_shapes`) in a subprocess with ONEDNN_VERBOSE=1 and report whether oneDNN
    executed them on AMX kernels. Never raises. ``max_cpu_isa`` caps oneDNN's ISA
    (ONEDNN_MAX_CPU_ISA, e.g. "AVX512_CORE_BF16"); otherwise the caller's environment passes through."""
    shapes = tuple(tuple(int(x) for x in s) for s in (shapes or encoder_matmul_shapes()))
    env = dict(os.environ)
    env["ONEDNN_VERBOSE"] = "1"
    env["DNNL_VERBOSE"] = "1"
    if max_cpu_isa:
        env["ONEDNN_MAX_CPU_ISA"] = max_cpu_isa
        env["DNNL_MAX_CPU_ISA"] = max_cpu_isa
    cap = env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or None
    cap_txt = f" [ONEDNN_MAX_CPU_ISA={cap}]" if cap else ""
    try:
        proc = subprocess.run([sys.executable, "-c", _AMX_CHILD, json.dumps(shapes)], check=False, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        ev = parse_onednn_verbose(out)
        return _with(ev, reason=f"oneDNN probe timed out after {timeout_s}s{cap_txt}; {ev.reason}",
                     max_cpu_isa=cap)
    except Exception as e:
        return AmxEvidence(False, "", [], "", f"could not start the oneDNN probe subprocess: {error_text(e)}",
                           max_cpu_isa=cap)
    ev = parse_onednn_verbose(proc.stdout + "\n" + proc.stderr)
    if "fdx: torch" in proc.stdout and " mkldnn False" in proc.stdout:
        ev = _with(ev, reason="torch.backends.mkldnn.is_available() is False in this torch build; " + ev.reason)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return _with(ev, reason=f"oneDNN probe subprocess exited {proc.returncode}{cap_txt}: {tail}; {ev.reason}",
                     max_cpu_isa=cap)
    return _with(ev, reason=ev.reason + cap_txt, max_cpu_isa=cap)


def _with(ev: AmxEvidence, **kw) -> AmxEvidence:
    return dataclasses.replace(ev, **kw)


@functools.lru_cache(maxsize=8)
def _cached_encoder_evidence(cap: str | None) -> AmxEvidence:
    return onednn_amx_evidence(max_cpu_isa=cap)


def amx_evidence_for_encoder() -> AmxEvidence:
    """:func:`onednn_amx_evidence` on the encoder's own matmul shapes, once per process and per
    ONEDNN_MAX_CPU_ISA value (a subprocess takes seconds; the answer cannot change otherwise)."""
    return _cached_encoder_evidence(os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None)


def probe_cpu_amx(cpuinfo_text: str | None = None, cpuinfo_path: str | None = None,
                  evidence: AmxEvidence | None = None) -> ProbeResult:
    """:func:`probe_cpu` plus oneDNN's AMX evidence when the flags say AMX (``evidence``: use
    this instead of running the subprocess, for tests). Never raises."""
    r = probe_cpu(cpuinfo_text, cpuinfo_path)
    if not r.details.get("has_amx"):
        return r
    try:
        ev = evidence if evidence is not None else amx_evidence_for_encoder()
        shapes = encoder_matmul_shapes()
        missing = ev.non_amx(shapes)
    except Exception as e:
        ev, missing = None, [f"evidence unavailable: {error_text(e)}"]
    proven = not missing
    details = dict(r.details, amx_proven=proven, amx_evidence=ev.to_dict() if ev else None)
    if proven:
        why = (f"oneDNN ran all {len(shapes)} of the encoder's bf16 matmuls on AMX "
               f"({', '.join(k for k in ev.kernels if _is_amx_impl(k))})")
    else:
        why = (f"AMX flags present but oneDNN did not run the encoder's bf16 matmuls on AMX "
               f"({'; '.join(missing[:3])}{'; ...' if len(missing) > 3 else ''}): {ev.reason if ev else ''}")
    details["amx_reason"] = why
    devices = r.devices if proven else tuple(dataclasses.replace(d, family="cpu") for d in r.devices)
    return dataclasses.replace(r, reason=f"{r.reason}; {why}", details=details, devices=devices)
