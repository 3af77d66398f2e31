"""``deepcabac update`` / ``info`` / ``report`` on update files, and the federated helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepcabac_py.cli.main import main
from deepcabac_py.errors import UpdateMismatchError
from deepcabac_py.updates.federated import FedClient, FedServer, crc_of_model
from deepcabac_py.updates.messages import read_update_header


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
    res = r.invoke(main, ["update", "apply", str(models / "base.pt"), str(models / "bad.dcu"), "-o", str(models / "y.pt")])
    assert res.exit_code == 1
    # existing output without --force
    res = r.invoke(main, ["update", "encode", "--base", str(models / "base.pt"), str(models / "new.pt"), "-o", str(out)])
    assert res.exit_code == 1


def test_federated_rounds_keep_everyone_in_sync():
    g = np.random.default_rng(0)
    init = {"w": g.normal(size=(16, 24)).astype(np.float32), "b": np.zeros(16, np.float32)}
    server = FedServer(init, density=0.05)
    clients = [FedClient(c, init, density=0.05) for c in range(4)]
    for r in range(6):
        chosen = [r % 4, (r + 1) % 4]  # partial participation: clients miss rounds
        for c in chosen:
            cl = clients[c]
            cl.sync(server.catch_up(cl.round))
            assert crc_of_model(cl.model) == crc_of_model(server.model)
            local = {k: v + 0.01 * g.normal(size=v.shape).astype(np.float32) for k, v in cl.model.items()}
            server.receive(c, cl.upstream(local))
        server.aggregate()
    lagging = clients[3]
    catch = server.catch_up(lagging.round)
    assert catch.messages and catch.full_model is None
    lagging.sync(catch)
    assert crc_of_model(lagging.model) == crc_of_model(server.model)
    # a stale upstream message (parent = an old round) is refused
    stale = FedClient(9, init, density=0.05)
    with pytest.raises(UpdateMismatchError):
        server.receive(9, stale.upstream({k: v + 1 for k, v in init.items()}))
    # when the missed messages outweigh the model, the full model (and session) is sent
    server.keep_messages = 1
    server.messages = {server.round: server.messages[server.round]}
    full = server.catch_up(0)
    assert full.full_model is not None
    fresh = FedClient(8, init, density=0.05)
    fresh.sync(full)
    assert crc_of_model(fresh.model) == crc_of_model(server.model)
    local = {k: v + 0.01 for k, v in fresh.model.items()}
    server.receive(8, fresh.upstream(local))  # the resynchronised client takes part again
    server.aggregate()
    fresh.sync(server.catch_up(fresh.round))
    assert crc_of_model(fresh.model) == crc_of_model(server.model)


def test_downstream_density_is_the_servers_own():
    g = np.random.default_rng(1)
    init = {"w": g.normal(size=(40, 50)).astype(np.float32)}
    for down, expected in ((None, 20), (0.02, 40)):  # keep_count of 2,000 weights at 0.01 and 0.02
        server = FedServer(init, density=0.01, down_density=down)
        clients = [FedClient(c, init, density=0.01) for c in range(3)]
        for c, cl in enumerate(clients):  # three disjoint-ish updates: the mean has up to 60 nonzeros
            server.receive(c, cl.upstream({"w": init["w"] + g.normal(size=(40, 50)).astype(np.float32)}))
        msg = server.aggregate()
        assert read_update_header(msg).nnz == expected
        clients[0].sync(server.catch_up(0))
        assert crc_of_model(clients[0].model) == crc_of_model(server.model)


def test_server_learning_rate_scales_the_aggregate():
    g = np.random.default_rng(3)
    init = {"w": g.normal(size=(30, 40)).astype(np.float32)}
    local = [{"w": init["w"] + g.normal(size=(30, 40)).astype(np.float32)} for _ in range(3)]
    moved = {}
    for lr in (1.0, 2.0):
        server = FedServer(init, density=0.02, server_lr=lr)
        clients = [FedClient(c, init, density=0.02) for c in range(3)]
        for c, cl in enumerate(clients):
            server.receive(c, cl.upstream(local[c]))
        server.aggregate()
        clients[0].sync(server.catch_up(0))
        assert crc_of_model(clients[0].model) == crc_of_model(server.model)
        moved[lr] = server.model["w"].astype(np.float64) - init["w"]
    # the same positions, each moved twice as far (the first round has no residual yet)
    assert np.count_nonzero(moved[1.0]) > 0
    np.testing.assert_array_equal(moved[1.0] != 0, moved[2.0] != 0)
    np.testing.assert_allclose(moved[2.0], 2 * moved[1.0], rtol=1e-5, atol=1e-6)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="server_lr"):
            FedServer(init, server_lr=bad)


def test_zero_dimensional_tensors_keep_their_shape_through_rounds():
    init = {"w": np.ones((8, 4), np.float32), "steps": np.array(0, np.int64), "scale": np.array(1.5, np.float32)}
    server, client = FedServer(init, density=0.25), FedClient(0, init, density=0.25)
    client.sync(server.catch_up(0))
    local = {"w": init["w"] + 0.1, "steps": np.array(5, np.int64), "scale": np.array(2.0, np.float32)}
    server.receive(0, client.upstream(local))
    server.aggregate()
    client.sync(server.catch_up(client.round))
    for model in (server.model, client.model):
        assert {k: v.shape for k, v in model.items()} == {"w": (8, 4), "steps": (), "scale": ()}
        assert int(model["steps"]) == 5


def test_cli_test_checks_update_files(models):
    from deepcabac_py.updates.messages import UpdateSession, apply_update, encode_update

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
