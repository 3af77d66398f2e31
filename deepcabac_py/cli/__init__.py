"""The ``deepcabac`` command line (click).

May import: anything in the package; nothing imports it. ``main`` holds the group and the model
commands, ``update`` the ``update`` group, ``series`` the ``series`` group, ``directories`` the
commands on checkpoint directories, ``sweep`` the ``sweep`` command and ``plots`` its pictures and
report's, ``common`` what they share (errors, input, outputs, progress).

The library's warnings (:class:`~deepcabac_py.errors.DeepCabacWarning`: a tensor stored raw, a step
made coarser, values dropped) are printed in the CLI's voice, one line each, from here on: this
runs before the commands' modules compile or load any kernel.
"""

import sys
import warnings

from ..errors import DeepCabacWarning

_python_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if isinstance(category, type) and issubclass(category, DeepCabacWarning):
        print(f"deepcabac: warning: {message}", file=file or sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


warnings.showwarning = _show_warning
