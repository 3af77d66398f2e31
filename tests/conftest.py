"""Suite-wide set-up: the Numba kernels compiled once, on every core, before the workers start
(see ``warm_kernels.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    # the controller only (xdist workers have ``workerinput``), and not when the JIT is off
    if hasattr(config, "workerinput") or os.environ.get("NUMBA_DISABLE_JIT") == "1":
        return
    script = str(HERE / "warm_kernels.py")
    procs = [subprocess.Popen([sys.executable, script, str(part)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for part in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:  # (the tests themselves will say what is wrong)
            sys.stderr.write(f"warm_kernels.py failed:\n{err.decode()[-2000:]}\n")
