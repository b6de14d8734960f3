"""msmodelslim: post-training quantization for Kimi-K3 in the style of Ascend's msModelSlim."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("msmodelslim")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+source"
