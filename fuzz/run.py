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

    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        # The kernels run as plain Python: instrument them too, so that the fuzzer is guided by the
        # branches of the arithmetic decoders themselves (slow, but it sees inside the kernels).
        with atheris.instrument_imports(include=["deepcabac_py"]):
            import deepcabac_py.cli.main
            import deepcabac_py.cli.update
            import deepcabac_py.integrations.zarr_codec  # noqa: F401,F811
            import deepcabac_py.matrix.formats
            import deepcabac_py.model._planning_kernels
            import deepcabac_py.model.decoder
            import deepcabac_py.model.encoder  # noqa: E401,F401
            import deepcabac_py.model.levels
            import deepcabac_py.model.model_plan
            import deepcabac_py.model.parallel
            import deepcabac_py.model.report  # noqa: E401,F401
            import deepcabac_py.model.settings
            import deepcabac_py.model.tensor_plan
            import deepcabac_py.updates.messages
    else:
        # Modules holding numba kernels (incl. codec, golomb, quantize) are not instrumented: numba
        # cannot compile instrumented bytecode. They are imported in dependency order so that the
        # Python parsers and validators around them are instrumented.
        import deepcabac_py._jit  # noqa: E401,F401
        import deepcabac_py.entropy._cabac_kernels
        import deepcabac_py.matrix._matrix_kernels
        import deepcabac_py.quant._quantizer_kernels  # noqa: E401,F401
        import deepcabac_py.quant._reconstruct_kernels
        import deepcabac_py.quant.quantizers
        import deepcabac_py.quant.reconstruct
        import deepcabac_py.quant.steps
        import deepcabac_py.updates._update_kernels
        import deepcabac_py.updates.golomb  # noqa: E401,F401
        with atheris.instrument_imports(include=["deepcabac_py"]):
            import deepcabac_py.entropy.levelcoder
            import deepcabac_py.errors  # noqa: E401,F401
            import deepcabac_py.io.checkpoint  # noqa: E401,F401
            import deepcabac_py.io.dtypes
            import deepcabac_py.io.files
            import deepcabac_py.model.container
            import deepcabac_py.updates.messages
            import deepcabac_py.updates.sparsify
        import deepcabac_py.model._planning_kernels  # noqa: F401
        import deepcabac_py.model.decoder
        import deepcabac_py.model.encoder
        import deepcabac_py.model.levels
        import deepcabac_py.model.model_plan
        import deepcabac_py.model.parallel
        import deepcabac_py.model.settings
        import deepcabac_py.model.tensor_plan
        with atheris.instrument_imports(include=["deepcabac_py"]):
            import deepcabac_py.cli.main
            import deepcabac_py.cli.update
            import deepcabac_py.integrations.zarr_codec
            import deepcabac_py.matrix.formats  # noqa: E401,F401
            import deepcabac_py.model.report  # noqa: E401,F401
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
