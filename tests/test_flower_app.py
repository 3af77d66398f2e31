"""examples/flower_app run end to end through ``flwr run`` (flwr 1.42's CLI), as a user runs it.

``flwr run`` starts a detached local SuperLink (``flower-superlink``, found on PATH) in simulation
mode and submits the app to it; the SuperLink's simulation runs the ServerApp and 8 simulated
SuperNodes with Ray. What the test sets, each because the run fails or reaches out without it:

* PATH starting with this interpreter's bin (``flower-superlink`` and the processes it starts);
* ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``: otherwise the app's dependencies are installed
  with ``uv sync`` into a fresh environment per run, from the package index (and deepcabac-py is not
  there: exit code 608);
* ``--federation-config num-supernodes=8`` (the default federation has 2 simulated SuperNodes, and
  the app waits for 8);
* ``FLWR_HOME`` in tmp_path (config.toml, the SuperLink's database and log, installed apps), free
  ports for the local SuperLink, ``RAY_TMPDIR`` in a fresh temporary folder, no update check and no
  telemetry.

``flwr run`` exits 0 even when the run fails, so success is read from the ServerApp's last line.
The SuperLink outlives ``flwr run``: the test ends it (and what it started) by process id.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).resolve().parents[1] / "examples" / "flower_app"
ROUNDS = 2
TIMEOUT = 240  # seconds for the whole `flwr run --stream` (about 50 s on this 2-core machine, more under load)
RESULT = re.compile(r"^accuracy (?P<before>\S+) -> (?P<after>\S+) after (?P<rounds>\d+) rounds, "
                    r"bytes up (?P<up>\d+) down (?P<down>\d+)\s*$", re.MULTILINE)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on the loopback now (all bound at once, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process now running."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    return out


def _stop_local_superlink(flwr_home: Path) -> None:
    """End the SuperLink that ``flwr run`` started for this FLWR_HOME, and its descendants."""
    procs = _processes()
    marker = str(flwr_home / "local-superlink")
    pids = [pid for pid, (_, cmd) in procs.items() if "flower-superlink" in cmd and marker in cmd]
    family = set(pids)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in procs.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in family if os.path.exists(f"/proc/{p}")]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_running(p) for p in alive):
            time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_flwr_run_example_app(tmp_path):
    flwr = Path(sys.executable).parent / "flwr"
    assert flwr.exists(), f"no flwr next to {sys.executable}"
    flwr_home = tmp_path / "flwr-home"
    # Ray puts Unix sockets under its temp dir: keep the path short (tmp_path can be too long for them).
    ray_tmp = tempfile.mkdtemp(prefix="ray-")
    http_port, control_port = _free_ports(2)
    env = dict(os.environ)
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        "NO_COLOR": "1",
        "COLUMNS": "200",
    })
    cmd = [str(flwr), "run", str(APP), "--stream", "--run-config", f"num-server-rounds={ROUNDS}",
           "--federation-config", "num-supernodes=8"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT)
    finally:
        _stop_local_superlink(flwr_home)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    log = flwr_home / "local-superlink" / "superlink.log"
    detail = f"flwr run exited {proc.returncode} after {elapsed:.0f}s:\n{output[-6000:]}"
    if log.exists():
        detail += f"\n--- superlink.log (tail) ---\n{log.read_text(errors='replace')[-3000:]}"
    assert proc.returncode == 0, detail
    assert "Successfully started run" in output, detail
    assert "8 simulated SuperNodes" in output, detail
    match = RESULT.search(output)
    assert match is not None, detail
    before, after = float(match["before"]), float(match["after"])
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0, match.group(0)
    assert int(match["rounds"]) == ROUNDS, match.group(0)
    assert int(match["up"]) > 0 and int(match["down"]) > 0, match.group(0)
