"""FD_* environment variables, read when asked (never cached at import), with their defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str
    parse: Callable[[str], object] = str

    def get(self):
        raw = os.environ.get(self.name, self.default)
        try:
            return self.parse(raw)
        except ValueError:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {self.help}") from None


FD_LOG_LEVEL = EnvVar("FD_LOG_LEVEL", "INFO", "logging level (DEBUG, INFO, WARNING)")


def _positive_int(raw: str) -> int:
    value = int(raw.strip().replace("_", ""))
    if value <= 0:
        raise ValueError(raw)
    return value


FD_MAX_IMAGE_PIXELS = EnvVar("FD_MAX_IMAGE_PIXELS", str(64 * 1024 * 1024),
                             "a positive pixel count: images with more width*height pixels are refused "
                             "before decoding (decompression bombs)", _positive_int)
FD_POS_EMBED_CACHE_SIZE = EnvVar("FD_POS_EMBED_CACHE_SIZE", "64",
                                 "entries of the per-(h, w) position-embedding/rotary LFU cache", int)


def _bool01(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(raw)


# FastDeploy forces this on for PaddleOCR-VL; the engine logs the value it runs with.
FD_ENABLE_MAX_PREFILL = EnvVar("FD_ENABLE_MAX_PREFILL", "1",
                               "1: admit up to max_num_seqs requests per step, whole prompts, one packed vision "
                               "pass per step; 0: per-request image encoding and chunked prefill under "
                               "max_num_batched_tokens", _bool01)

FD_CAPABILITIES = EnvVar("FD_CAPABILITIES", "",
                         "a YAML file of capability rows overriding the ones backends ship "
                         "(same as --capabilities; see fastdeploy_ext/capabilities.py)")


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


FD_EMULATE = EnvVar("FD_EMULATE", "",
                    "comma list of backends to run in their emulation mode (e.g. metax: a fake SDK, no card; "
                    "every probe, plan and report then says EMULATED)", _names)
FD_CPUINFO = EnvVar("FD_CPUINFO", "/proc/cpuinfo",
                    "the cpuinfo file the CPU probe reads (point it at a recorded one to simulate another CPU)")

# Measured on the H200 (docs/PERFORMANCE.md, the FA3 section): FA3 wins on a page (10764
# tokens) and on 16 blocks (longest 1024), loses on 64 small blocks (longest 320).
FD_FA3_MIN_SEQLEN = EnvVar("FD_FA3_MIN_SEQLEN", "512",
                           "a positive token count: the fa3_varlen backend runs FlashAttention-3 on a batch whose "
                           "longest sequence has at least this many tokens, the Triton kernel otherwise",
                           _positive_int)

ALL = (FD_LOG_LEVEL, FD_MAX_IMAGE_PIXELS, FD_POS_EMBED_CACHE_SIZE, FD_ENABLE_MAX_PREFILL, FD_CAPABILITIES, FD_EMULATE,
       FD_CPUINFO, FD_FA3_MIN_SEQLEN)
