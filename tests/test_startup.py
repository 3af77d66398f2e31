"""Start-up: a safetensors round trip never imports torch, gives the bytes the torch path gives, and
a first run says that it compiles before it waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import deepcabac_py as dc
from deepcabac_py.cli import common
from deepcabac_py.cli.main import main
from deepcabac_py.entropy import floatcoder, levelcoder
from deepcabac_py.io.checkpoint import RawTensor, dtype_name_of, flatten, tensor_of_bits, tensor_to_numpy
from deepcabac_py.io.files import load_checkpoint
from deepcabac_py.quant import quantizers

DEMO = Path(__file__).resolve().parent.parent / "models" / "digits_cnn.safetensors"

# The CLI in a fresh interpreter; prints which heavy modules it imported, as JSON on stdout.
_RUN = textwrap.dedent("""
    import json, sys
    from deepcabac_py.cli.main import main
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
""")


def _cli_fresh(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("startup") / "m.safetensors"
    tensors = {"w": (torch.randn(48, 40, generator=g) * 0.05).to(torch.bfloat16),
               "b": torch.randn(40, generator=g).to(torch.float16), "steps": torch.arange(5, dtype=torch.int64)}
    dc.save_checkpoint(flatten(tensors), path)
    return path


@pytest.mark.parametrize("which", ["demo", "bf16"])
def test_a_safetensors_round_trip_imports_no_torch_and_matches_the_torch_path(which, bf16_file, tmp_path):
    src = DEMO if which == "demo" else bf16_file
    stream, restored = tmp_path / "m.dcb", tmp_path / "back.safetensors"
    for args in (["encode", str(src), "-o", str(stream), "-q"], ["decode", str(stream), "-o", str(restored), "-q"],
                 ["info", str(stream)], ["test", str(stream), "-q"]):
        ran = _cli_fresh(*args)
        assert ran == {"code": 0, "torch": False}, args
    # the same bytes as the encoder fed torch tensors in this process, and the same decoded file
    assert stream.read_bytes() == dc.encode_model(load_checkpoint(src))
    expected = tmp_path / "expected.safetensors"
    dc.save_checkpoint(dc.decode_checkpoint(stream.read_bytes()), expected)
    assert restored.read_bytes() == expected.read_bytes()


def test_a_pt_output_still_gets_torch_tensors(bf16_file, tmp_path):
    stream, out = tmp_path / "m.dcb", tmp_path / "m.pt"
    assert CliRunner().invoke(main, ["encode", str(bf16_file), "-o", str(stream), "-q"]).exit_code == 0
    assert CliRunner().invoke(main, ["decode", str(stream), "-o", str(out), "-q"]).exit_code == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["w"].dtype == torch.bfloat16 and loaded["steps"].dtype == torch.int64
    assert torch.equal(loaded["steps"], torch.arange(5))


def test_raw_tensors_stand_for_torch_tensors():
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    raw = RawTensor(bits, "bfloat16")
    arr, name, is_torch = tensor_to_numpy(raw)
    assert arr is bits and name == "bfloat16" and is_torch and raw.shape == (2, 3)
    assert dtype_name_of(raw) == "bfloat16"
    assert dtype_name_of(RawTensor(np.zeros(2, np.uint8), "float8_e4m3fn")) is None
    with pytest.raises(TypeError, match="unsupported tensor dtype torch.float8_e4m3fn"):
        tensor_to_numpy(RawTensor(np.zeros(2, np.uint8), "float8_e4m3fn"))
    assert isinstance(tensor_of_bits(bits, "bfloat16", True), RawTensor)
    assert tensor_of_bits(bits, "uint16", False) is bits
    with pytest.raises(TypeError, match="does not carry"):
        tensor_of_bits(bits.astype(np.int32), "bfloat16", True)


def test_the_kernels_are_not_yet_compiled_until_their_first_call(tmp_path):
    # a fresh process with an empty Numba cache: the fronts' kernels are cold until the first
    # encode, and a second process finds them in the cache
    code = textwrap.dedent("""
        import numpy as np
        import deepcabac_py as dc
        from deepcabac_py.entropy import floatcoder, levelcoder
        from deepcabac_py.quant import quantizers

        def cold():
            return [levelcoder.first_call_compiles(decoder=False), quantizers.first_call_compiles("trellis"),
                    levelcoder.first_call_compiles(decoder=True), floatcoder.first_call_compiles(decoder=False)]

        before = cold()
        dc.encode_model({"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "n": np.arange(9)})
        print(before, cold())
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    # (decoding was never run, nor the float coder of lossless tensors: their kernels stay cold)
    assert runs[0].stdout.strip() == "[True, True, True, True] [False, False, True, True]"
    assert runs[1].stdout.strip() == "[False, False, True, True] [False, False, True, True]"


@pytest.mark.parametrize("cold_coder, cold_quantizer, cold_floats, lossless, task, shown", [
    (False, False, False, False, "encode", False), (True, False, False, False, "encode", True),
    (False, True, False, False, "encode", True), (False, True, False, False, "decode", False),
    (True, False, False, False, "decode", True), (False, False, True, False, "encode", False),
    (False, False, True, True, "encode", True), (False, False, True, True, "decode", True),
    (False, False, False, True, "decode", False)])
def test_the_compile_notice_appears_only_when_something_will_compile(cold_coder, cold_quantizer, cold_floats,
                                                                      lossless, task, shown, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(levelcoder, "first_call_compiles", lambda decoder: asked.append(decoder) or cold_coder)
    monkeypatch.setattr(quantizers, "first_call_compiles", lambda q: asked.append(q) or cold_quantizer)
    monkeypatch.setattr(floatcoder, "first_call_compiles", lambda decoder: asked.append(("floats", decoder))
                        or cold_floats)
    common.compile_notice(task, "rdoq", lossless)
    err = capsys.readouterr().err
    assert ("compiling kernels (first run only" in err) == shown
    assert asked[0] == (task != "encode")
    if task == "encode" and not cold_coder:
        assert asked[1] == "rdoq"
    # (the float coder is asked about only for lossless tensors, and about the task's direction)
    assert [a for a in asked if isinstance(a, tuple)] == ([("floats", task != "encode")]
                                                          if lossless and not (cold_coder or cold_quantizer) else [])


def test_a_changed_kernel_module_drops_every_cached_kernel(tmp_path, monkeypatch):
    # Numba keys a kernel's cache on its own file: one calling into a changed module would keep the
    # old machine code, so any kernel module's change drops the whole package's caches
    import numba

    from deepcabac_py import _jit
    from deepcabac_py._jit import drop_stale_caches

    monkeypatch.setattr(numba.config, "CACHE_DIR", "")  # (the caches beside the modules alone)
    monkeypatch.setattr(_jit, "_user_wide_cache", lambda: None)

    root = _kernel_package(tmp_path)
    for sub in ("entropy", "quant"):
        (root / sub / "__pycache__").mkdir()
    cached = [root / "entropy" / "__pycache__" / "a.nbi", root / "quant" / "__pycache__" / "b.1.nbc"]
    other = root / "quant" / "__pycache__" / "plain.cpython-311.pyc"

    def fill():
        for f in cached + [other]:
            f.write_bytes(b"x")

    drop_stale_caches(str(root))  # (no stamp yet: whatever is cached cannot be trusted)
    fill()
    drop_stale_caches(str(root))
    assert all(f.exists() for f in cached)  # nothing changed: kept
    (root / "entropy" / "_entropy_kernels.py").write_text("x = 22\n")
    drop_stale_caches(str(root))
    assert not any(f.exists() for f in cached) and other.exists()
    fill()
    drop_stale_caches(str(root))
    assert all(f.exists() for f in cached)
    # the package's own Numba helpers are compiled into the kernels too
    (root / "_jit.py").write_text("y = 1\n")
    drop_stale_caches(str(root))
    assert not any(f.exists() for f in cached)
    fill()
    drop_stale_caches(str(root))
    assert all(f.exists() for f in cached)


def _kernel_package(tmp_path):
    root = tmp_path / "pkg"
    for sub in ("entropy", "quant"):
        (root / sub).mkdir(parents=True)
        (root / sub / f"_{sub}_kernels.py").write_text("x = 1\n")
    return root


@pytest.mark.parametrize("place", ["NUMBA_CACHE_DIR", "user-wide"])
def test_stale_kernels_are_dropped_where_numba_caches_them_outside_the_package(tmp_path, monkeypatch, place):
    # Numba stamps a cached kernel with its own file (recent releases with its contents): under NUMBA_CACHE_DIR,
    # or in the user-wide cache of a read-only install, a kernel whose file an upgrade left as it was
    # would keep the machine code of the modules it calls; the stamp guards those places too
    import numba

    from deepcabac_py import _jit
    from deepcabac_py._jit import _cache_subpath, drop_stale_caches

    root = _kernel_package(tmp_path)
    base = tmp_path / "cache"
    if place == "NUMBA_CACHE_DIR":
        monkeypatch.setattr(numba.config, "CACHE_DIR", str(base))
    else:  # (a package whose directories cannot be written: its caches go to the user-wide place)
        monkeypatch.setattr(numba.config, "CACHE_DIR", "")
        monkeypatch.setattr(_jit, "_user_wide_cache", lambda: str(base))
        real_refresh = _jit._refresh
        monkeypatch.setattr(_jit, "_refresh", lambda stamp, places, marker, create: False
                            if str(root) in marker else real_refresh(stamp, places, marker, create))
    cached = [base / _cache_subpath(str(root / sub)) / f"{sub}.f-3.py311.nbi" for sub in ("entropy", "quant")]

    def fill():
        for f in cached:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"x")

    drop_stale_caches(str(root))
    fill()
    drop_stale_caches(str(root))
    assert all(f.exists() for f in cached)  # nothing changed: kept
    (root / "quant" / "_quant_kernels.py").write_text("x = 22\n")  # (one module alone, as a checkout changes it)
    drop_stale_caches(str(root))
    assert not any(f.exists() for f in cached)
    fill()
    drop_stale_caches(str(root))
    assert all(f.exists() for f in cached)


def test_the_cache_places_are_where_numba_puts_a_kernel(tmp_path, monkeypatch):
    # the guard names Numba's directories as numba.core.caching does: held together here
    import numba
    from numba.core import caching

    from deepcabac_py._jit import _cache_subpath
    from deepcabac_py.entropy import _float_kernels

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    kernel = _float_kernels.rank_classes
    # (a private name, _UserProvidedCacheLocator, in older Numba releases)
    UserProvidedCacheLocator = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
    locator = UserProvidedCacheLocator.from_function(kernel.py_func, _float_kernels.__file__)
    assert locator.get_cache_path() == str(tmp_path / _cache_subpath(os.path.dirname(_float_kernels.__file__)))
