"""ClientApp: a plain FedAvg train function; ``deepcabac_mod`` does all the compression around it.

The mod turns the server's compressed downstream into the global model's ``ArrayRecord`` before
``train`` runs, and replaces the trained model in the reply with one sparse update message.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from deepcabac_py.integrations.flower import deepcabac_mod

from .task import make_net, shard, train_steps

app = ClientApp(mods=[deepcabac_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    net = make_net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = shard(int(context.node_config["partition-id"]))
    train_steps(net, x, y, steps=int(context.run_config["local-steps"]), lr=float(context.run_config["lr"]))
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(content, reply_to=msg)
