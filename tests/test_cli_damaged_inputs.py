"""Every command of the CLI over the corpus of damaged inputs (tests/damaged_inputs.py): exit status
1 (2 for a usage error), one line on stderr, no traceback, no output left behind, bounded time and
memory."""

from __future__ import annotations

import tracemalloc

import damaged_inputs
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import no_hang

from deepcabac_py.cli.main import main

COMMANDS = {
    "encode": lambda src, out, base: ["encode", src, "-o", out / "x.dcb"],
    "decode": lambda src, out, base: ["decode", src, "-o", out / "x.pt"],
    "info": lambda src, out, base: ["info", src],
    "report": lambda src, out, base: ["report", src],
    "test": lambda src, out, base: ["test", src],
    "update-apply": lambda src, out, base: ["update", "apply", base, src, "-o", out / "x.pt"],
    "update-encode": lambda src, out, base: ["update", "encode", src, "--base", base, "-o", out / "x.dcu"],
}
PEAK = 128 << 20
# info and report on a stream read its header only: damage in the payload is test's and decode's
PAYLOAD_ONLY = {"payload-flipped.dcb"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    where = tmp_path_factory.mktemp("damaged")
    base = where / "base.pt"
    torch.save({"w": torch.from_numpy(np.zeros((40, 30), np.float32))}, base)
    _warm_up(where, base)
    return damaged_inputs.write(where / "inputs"), base


def _warm_up(where, base):
    """Run every command once on good inputs: with an empty Numba cache the kernels compile on
    first use, and compiling under tracemalloc takes minutes, which is not what is measured here."""
    new = where / "new.pt"
    torch.save({"w": torch.from_numpy(np.ones((40, 30), np.float32))}, new)
    good = where / "good"
    good.mkdir()
    stream, message = good / "m.dcb", good / "u.dcu"
    runs = [
        ["encode", base, "-o", stream],
        ["update", "encode", new, "--base", base, "-o", message],
        ["decode", stream, "-o", good / "m.pt"],
        ["update", "apply", base, message, "-o", good / "u.pt"],
    ]
    runs += [[command, src] for src in (stream, message) for command in ("info", "report", "test")]
    runner = _runner()
    for args in runs:
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, (args, result.output)


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 keeps stderr apart
        return CliRunner()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_every_damaged_input(command, corpus, tmp_path):
    inputs, base = corpus
    runner, failures = _runner(), []
    for src in inputs:
        if command in ("info", "report") and src.name in PAYLOAD_ONLY:
            continue
        out = tmp_path / src.name
        out.mkdir()
        args = [str(a) for a in COMMANDS[command](src, out, base)]
        tracemalloc.start()
        try:
            with no_hang(60):
                result = runner.invoke(main, args, catch_exceptions=True)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        err = result.stderr
        lines = err.strip().splitlines()
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            failures.append(f"{src.name}: raised {type(result.exception).__name__}: {result.exception}")
        elif result.exit_code not in (1, 2) or "Traceback" in err:
            failures.append(f"{src.name}: exit {result.exit_code}: {err[-300:]}")
        elif result.exit_code == 1 and (len(lines) != 1 or not lines[0].startswith("deepcabac: error: ")):
            failures.append(f"{src.name}: stderr is not one error line: {err[-300:]}")
        elif result.exit_code == 2 and not (lines and lines[-1].startswith("Error: ")):
            failures.append(f"{src.name}: a usage error without its message: {err[-300:]}")
        elif list(out.iterdir()):
            failures.append(f"{src.name}: left {[p.name for p in out.iterdir()]} behind")
        elif peak > PEAK:
            failures.append(f"{src.name}: traced peak {peak / 2**20:.0f} MiB")
    assert not failures, "\n".join(failures)
