"""Mamba-2 in plain PyTorch: reference SSD scans (recurrent and chunked) and the mixer layer."""

from hspec.ssm.mixer import GatedRMSNorm, Mamba2Config, Mamba2Mixer, count_mixer_params
from hspec.ssm.ssd import segsum, ssd_chunked, ssd_recurrent

__all__ = [
    "GatedRMSNorm",
    "Mamba2Config",
    "Mamba2Mixer",
    "count_mixer_params",
    "segsum",
    "ssd_chunked",
    "ssd_recurrent",
]
