"""The federated helpers: client and server keep in sync over rounds, both directions coded."""

from __future__ import annotations

import numpy as np
import pytest

from deepcabac_py.errors import UpdateMismatchError
from deepcabac_py.updates.federated import FedClient, FedServer, crc_of_model
from deepcabac_py.updates.message_format import read_update_header


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
