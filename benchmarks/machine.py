"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np

from dlpipe.machine import usable_cpus

__all__ = ["machine_info"]


def machine_info(**versions: Any) -> dict[str, Any]:
    """CPU counts, platform, Python and numpy versions, plus the given package versions."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        **versions,
    }
