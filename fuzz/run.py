"""Run one fuzz target under atheris (libFuzzer), seeded from fuzz/corpus/<target>/.

    .venv/bin/python fuzz/run.py TARGET -runs=100000 [more libFuzzer flags]
    .venv/bin/python fuzz/run.py --list
    NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=/tmp/dc-numba-bc .venv/bin/python fuzz/run.py model_sealed -runs=20000

New coverage-increasing inputs go to a work directory (``--work DIR``, default
/tmp/deepcabac-fuzz/<target>), never into the committed seed corpus. Crashing inputs (a target
raising ``fuzz_targets.Finding``) and timeouts are written to ``fuzz/artifacts/<target>/``. Defaults
added unless given: ``-timeout=10 -rss_limit_mb=4096 -max_len=65536``.

The numba kernels are compiled, not Python, so atheris sees the coverage of the Python parsers and
validators only; set NUMBA_DISABLE_JIT=1 to run the kernels as (slow, instrumented) Python.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    args = argv[1:]
    work = None
    if "--work" in args:
        i = args.index("--work")
        work = args[i + 1]
        del args[i:i + 2]
    sys.path.insert(0, str(HERE))
    if not args or args[0] in ("-h", "--help", "--list"):
        from fuzz_targets import TARGETS
        print(__doc__)
        print("targets:", " ".join(TARGETS))
        return 0
    target, flags = args[0], args[1:]

    try:
        import atheris
    except ImportError:
        print("atheris is not installed: .venv/bin/pip install atheris (or '.[fuzz]')", file=sys.stderr)
        return 2

    # numba cannot compile instrumented bytecode: the kernel modules (every one is named
    # _*kernels.py) are imported first, uninstrumented, and every other module of the package under
    # instrumentation. With the JIT off the kernels run as plain Python and are instrumented too, so
    # that the fuzzer is guided by the branches of the arithmetic decoders themselves (slow, but it
    # sees inside the kernels).
    package = HERE.parent / "deepcabac_py"
    modules = {".".join(p.relative_to(HERE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in sorted(package.rglob("*.py"))}
    optional = ("deepcabac_py.integrations.flower", "deepcabac_py.integrations.ddp")  # not fuzz targets
    if os.environ.get("NUMBA_DISABLE_JIT") != "1":
        for name, path in modules.items():
            if path.name.endswith("kernels.py"):
                importlib.import_module(name)
    with atheris.instrument_imports(include=["deepcabac_py"]):
        for name in modules:
            if name not in optional:
                importlib.import_module(name)
    if target.startswith("ckpt_pt"):
        # torch's weights-only unpickler is pure Python: instrumenting its opcode loop lets the
        # fuzzer steer through pickle opcodes instead of guessing blindly behind the zip framing.
        import torch._weights_only_unpickler as wou
        wou.Unpickler.load = atheris.instrument_func(wou.Unpickler.load)
        wou._read_global_instruction = atheris.instrument_func(wou._read_global_instruction)
    with atheris.instrument_imports(include=["fuzz_targets"]):
        import fuzz_targets

    if target not in fuzz_targets.TARGETS:
        print(f"unknown target {target!r}; targets: {' '.join(fuzz_targets.TARGETS)}", file=sys.stderr)
        return 2
    fn = fuzz_targets.TARGETS[target]

    seeds = HERE / "corpus" / target
    work = Path(work or Path(os.environ.get("TMPDIR", "/tmp")) / "deepcabac-fuzz" / target)
    work.mkdir(parents=True, exist_ok=True)
    artifacts = HERE / "artifacts" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    defaults = {"-timeout": "10", "-rss_limit_mb": "4096", "-max_len": "65536",
                "-artifact_prefix": f"{artifacts}/"}
    for key, value in defaults.items():
        if not any(f.startswith(key + "=") for f in flags):
            flags.append(f"{key}={value}")

    # warm the numba kernels (and their cache) before libFuzzer starts timing inputs
    for p in sorted(seeds.iterdir()):
        fn(p.read_bytes())

    def one_input(data: bytes) -> None:
        fn(data)

    atheris.Setup([sys.argv[0], *flags, str(work), str(seeds)], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
