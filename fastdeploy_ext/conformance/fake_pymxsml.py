"""EMULATED pymxsml for running the MetaX runner without a MetaX card (conformance only).

Implements just the calls fastdeploy_ext.platforms.probe_metax makes, reporting one
"MetaX C500" with 64 GiB. `__fdx_emulated__` makes every probe, plan and report say "emulated".
"""
from types import SimpleNamespace

__fdx_emulated__ = True


def mxSmlInit():
    return 0


def mxSmlGetDeviceCount():
    return 1


def mxSmlGetDeviceInfo(index):
    return SimpleNamespace(deviceName="MetaX C500")


def mxSmlGetMemoryInfo(index):
    return SimpleNamespace(vramTotal=64 * 1024 * 1024)      # KiB


def mxSmlGetMacaVersion():
    return "emulated"


def mxSmlShutdown():
    return 0
