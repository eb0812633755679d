"""A fake `acme_smi` for CI machines without an Acme card: the same calls as the real binding
(probe.py lists them), one "Acme N1", marked EMULATED so every report says so."""
EMULATED = True


def init() -> None:
    pass


def shutdown() -> None:
    pass


def device_count() -> int:
    return 1


def device_name(index: int) -> str:
    return "Acme N1"


def memory_total(index: int) -> int:
    return 16 * 1024 ** 3


def driver_version() -> str:
    return "0.0-emulated"
