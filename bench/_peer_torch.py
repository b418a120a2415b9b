"""Caffe's LeNet (models/lenet) in PyTorch for the external peers, its test, the single-process loop and DDP over gloo under Spark's TorchDistributor."""

import itertools
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import _peer_common

VERSIONS = ("torch",)


class LeNet(nn.Module):
    """models/lenet: uint8 images N×28×28 in, logits out; Caffe's xavier fillers, zero biases."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.conv1, self.conv2 = nn.Conv2d(1, 20, 5), nn.Conv2d(20, 50, 5)
        self.ip1, self.ip2 = nn.Linear(800, 500), nn.Linear(500, 10)
        for layer in (self.conv1, self.conv2, self.ip1, self.ip2):
            bound = math.sqrt(3 / layer.weight[0].numel())  # Caffe's xavier: U(±√(3/fan_in))
            nn.init.uniform_(layer.weight, -bound, bound)
            nn.init.zeros_(layer.bias)

    def forward(self, images):
        x = images.unsqueeze(1).float() * self.scale  # transform_param's scale, as Caffe's Data layer applies it
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        return self.ip2(F.relu(self.ip1(x.flatten(1))))


def sgd(model, config):
    # PyTorch adds weight_decay·w to the gradient, then v = m·v + g, w −= lr·v: Caffe's update at a constant lr.
    return torch.optim.SGD(model.parameters(), lr=config["base_lr"], momentum=config["momentum"],
                           weight_decay=config["weight_decay"])


def train(model, config, start, data, batch, steps, per_step, order, saves, stop=None):
    """`steps` SGD steps of `batch` images, whole batches in the order order(epoch) gives, each step worth `per_step`
    samples in all; if `saves`, the parameters written every milestone and after the last step, and with a `stop`
    (_peer_common.Stop) the run ends at a checkpoint that reaches its target."""
    images, labels = data
    optimizer, every, step = sgd(model, config), _peer_common.every(config, per_step), 0
    for epoch in itertools.count():
        indices = order(epoch)
        for first in range(0, len(indices) - batch + 1, batch):
            chosen = indices[first:first + batch]
            optimizer.zero_grad()
            F.cross_entropy(model(images[chosen]), labels[chosen]).backward()
            optimizer.step()
            step += 1
            if stop:
                stop.stepped()
            if saves and (step % every == 0 or step == steps):
                arrays = [p.detach().numpy().copy() for p in model.parameters()]
                _peer_common.save(config, start, step * per_step, arrays, stop.tested if stop else 0.0)
                if stop and stop.saved(arrays):
                    return step
            if step == steps:
                return step


def tensors(config):
    x, y, *_ = _peer_common.load(config)
    return torch.from_numpy(x), torch.from_numpy(y).long()


def single(config):
    """This process's loop over the whole training set, batch 64, reshuffled each epoch (seeded by config's seed)."""
    torch.manual_seed(config.get("seed", 0))
    data, batch, stop = tensors(config), config["batch"], _peer_common.Stop(config, tester)
    steps = round(config["epochs"] * len(data[0]) / batch)
    start = time.time()
    done = train(LeNet(config["scale"]), config, start, data, batch, steps, batch,
                 lambda _: torch.randperm(len(data[0])), saves=True, stop=stop)
    return {"clock": "from before the model is built (torch imported, the data in memory): building the model, "
                     "training, and the checkpoint writes",
            "epochs": done * batch / len(data[0]), "versions": _peer_common.versions(*VERSIONS), **stop.report(start)}


def ddp(config, start):
    """One DDP process of TorchDistributor's: its shard by DistributedSampler, batch 64 / processes, gloo."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    rank, processes = dist.get_rank(), dist.get_world_size()
    data, batch = tensors(config), config["batch"] // processes
    sampler = DistributedSampler(range(len(data[0])), num_replicas=processes, rank=rank, shuffle=True)

    def order(epoch):
        sampler.set_epoch(epoch)
        return torch.tensor(list(sampler))

    steps = round(config["epochs"] * len(data[0]) / (batch * processes))
    model = DistributedDataParallel(LeNet(config["scale"]))  # rank 0's initial weights, broadcast
    train(model, config, start, data, batch, steps, batch * processes, order, saves=rank == 0)
    dist.destroy_process_group()
    return steps * batch * processes / len(data[0])


def distributor(config):
    """TorchDistributor(local_mode=True): torchrun on the driver starts the DDP processes."""
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    SparkSession.builder.config(conf=_peer_common.spark_conf(config["workers"])).getOrCreate() \
        .sparkContext.setLogLevel("ERROR")
    start = time.time()
    epochs = TorchDistributor(num_processes=config["workers"], local_mode=True, use_gpu=False).run(ddp, config, start)
    return {"clock": "from before TorchDistributor.run (SparkSession up): torchrun started on the driver, its "
                     f"{config['workers']} processes' torch import, the gloo process group, each loading the data "
                     "and taking its shard, DDP's first broadcast, training, and rank 0's checkpoint writes",
            "epochs": epochs,
            "versions": _peer_common.versions(*VERSIONS, "pyspark")}


def tester(config, x_test, y_test):
    """test(weights) → the test accuracy of PyTorch parameters (parameters() order)."""
    model = LeNet(config["scale"]).eval()

    def test(arrays):
        with torch.no_grad():
            for parameter, array in zip(model.parameters(), arrays):
                parameter.copy_(torch.from_numpy(array))
            return _peer_common.accuracy(lambda chosen: model(torch.from_numpy(chosen)).numpy(), x_test, y_test)
    return test


RUNS = {"single": single, "distributor": distributor}
