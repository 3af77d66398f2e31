"""``deepcabac update`` and ``info`` / ``report`` / ``test`` on update files."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from deepcabac_py.cli.main import main
from deepcabac_py.updates.message_format import read_update_header


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2
        return CliRunner()


@pytest.fixture()
def models(tmp_path):
    torch.manual_seed(0)
    base = {"fc.weight": torch.randn(32, 64), "fc.bias": torch.randn(32), "n": torch.tensor(4)}
    new = {k: (v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v + 1) for k, v in base.items()}
    torch.save(base, tmp_path / "base.pt")
    torch.save(new, tmp_path / "new.pt")
    return tmp_path


def test_cli_encode_info_report_apply(models):
    r = _runner()
    out = models / "r7.dcu"
    res = r.invoke(main, ["update", "encode", "--base", str(models / "base.pt"), str(models / "new.pt"), "-o", str(out),
                          "--density", "0.05", "--round", "7", "--parent-round", "6"])
    assert res.exit_code == 0, res.output
    h = read_update_header(out.read_bytes())
    assert (h.round, h.parent_round) == (7, 6)
    res = r.invoke(main, ["info", str(out)])
    assert res.exit_code == 0 and "round 7 (parent round 6" in res.output and "fc.weight" in res.output
    res = r.invoke(main, ["info", "--json", str(out)])
    assert json.loads(res.output)[0]["nnz"] == h.nnz
    res = r.invoke(main, ["report", "--json", str(out)])
    rep = json.loads(res.output)[0]
    assert rep["ratio_vs_fp32"] > 10 and rep["ratio_vs_golomb"] > 0 and rep["bits_per_nonzero"] > 0
    res = r.invoke(main, ["update", "apply", str(models / "base.pt"), str(out), "-o", str(models / "applied.pt")])
    assert res.exit_code == 0, res.output
    applied = torch.load(models / "applied.pt")
    assert int(applied["n"]) == 5 and not torch.equal(applied["fc.weight"], torch.load(models / "base.pt")["fc.weight"])
    # the wrong base: one line, status 1
    res = r.invoke(main, ["update", "apply", str(models / "new.pt"), str(out), "-o", str(models / "x.pt")])
    assert res.exit_code == 1 and "wrong parent" in (res.stderr if hasattr(res, "stderr") else res.output)
    # a damaged file: the library's error, status 1
    bad = bytearray(out.read_bytes())
    bad[-6] ^= 0xFF
    (models / "bad.dcu").write_bytes(bytes(bad))
    res = r.invoke(main, ["update", "apply", str(models / "base.pt"), str(models / "bad.dcu"),
                          "-o", str(models / "y.pt")])
    assert res.exit_code == 1
    # existing output without --force
    res = r.invoke(main, ["update", "encode", "--base", str(models / "base.pt"), str(models / "new.pt"),
                          "-o", str(out)])
    assert res.exit_code == 1


def test_cli_test_checks_update_files(models):
    from deepcabac_py.updates.messages import apply_update, encode_update
    from deepcabac_py.updates.sessions import UpdateSession

    r = _runner()
    out = models / "r1.dcu"
    res = r.invoke(main, ["update", "encode", "--base", str(models / "base.pt"), str(models / "new.pt"),
                          "-o", str(out), "--density", "0.05"])
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["test", str(out)])
    assert res.exit_code == 0 and "OK (1 update message(s)" in (res.stderr if hasattr(res, "stderr") else res.output)

    # a stream of rounds in one session, each message decoded as a receiver would
    base = torch.load(models / "base.pt")
    session, mirror, messages, model = UpdateSession(3), UpdateSession(3), [], base
    for step in range(3):
        new = {k: (v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in model.items()}
        messages.append(encode_update(new, model, density=0.1, session=session, round_index=step + 1,
                                      parent_round=step))
        model = apply_update(model, messages[-1], session=mirror)  # the next parent is what receivers hold
    stream = models / "rounds.dcu"
    stream.write_bytes(b"".join(messages))
    res = r.invoke(main, ["test", str(stream)])
    assert res.exit_code == 0, res.output
    assert "3 update message(s)" in (res.stderr if hasattr(res, "stderr") else res.output)

    res = r.invoke(main, ["test", "--base", str(models / "base.pt"), str(stream)])
    assert res.exit_code == 0, res.output
    assert "3 update message(s) applied" in (res.stderr if hasattr(res, "stderr") else res.output)
    res = r.invoke(main, ["test", "--base", str(models / "new.pt"), str(stream)])  # not the parent
    assert res.exit_code == 1 and "wrong parent" in (res.stderr if hasattr(res, "stderr") else res.output)

    for damaged_at in (len(messages[0]) + 40, -6):
        bad = bytearray(stream.read_bytes())
        bad[damaged_at] ^= 0xFF
        (models / "bad.dcu").write_bytes(bytes(bad))
        res = r.invoke(main, ["test", str(models / "bad.dcu")])
        assert res.exit_code == 1 and "Traceback" not in res.output
