#!/usr/bin/env python3
"""Writes the larger nets of models/ (cifar10, CaffeNet, GoogLeNet, ResNet-18) from compact descriptions.

The prototxt files are committed; rerun this after changing a description:
    python3 tools/gen_zoo.py
Hyperparameters follow the published Caffe models (BVLC zoo, Caffe's cifar10
examples, He et al.'s ResNet with BatchNorm + Scale).
"""

import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")


class Net:
    def __init__(self, name, header):
        self.lines = [f"# {header}\n", f'name: "{name}"\n']

    def layer(self, name, kind, bottom=(), top=None, params=None, inner=None, include=None, extra=""):
        top = [name] if top is None else ([top] if isinstance(top, str) else top)
        bottom = [bottom] if isinstance(bottom, str) else list(bottom)
        text = f'  name: "{name}"\n  type: "{kind}"\n'
        text += "".join(f'  bottom: "{b}"\n' for b in bottom)
        text += "".join(f'  top: "{t}"\n' for t in top)
        if include:
            text += f"  include {{ phase: {include} }}\n"
        for lr, decay in params or ():
            text += f"  param {{ lr_mult: {lr} decay_mult: {decay} }}\n"
        text += extra
        if inner:
            key, body = inner
            text += f"  {key} {{\n" + "".join(f"    {line}\n" for line in body) + "  }\n"
        self.lines.append("layer {\n" + text + "}\n")
        return top[0]

    def data(self, source_train, source_test, batch_train, batch_test, transform_train, transform_test):
        for phase, source, batch, transform in (("TRAIN", source_train, batch_train, transform_train),
                                                ("TEST", source_test, batch_test, transform_test)):
            extra = f"  transform_param {{ {transform} }}\n" if transform else ""
            self.layer("data", "Data", top=["data", "label"], include=phase, extra=extra,
                       inner=("data_param", [f'source: "{source}"', f"batch_size: {batch}", "backend: LMDB"]))

    def imagenet(self, deploy, crop, train_batch, test_batch):
        """The ImageNet input: an Input layer for deployment, else Data layers with Caffe's crop and mean."""
        if deploy:
            self.input((10, 3, crop, crop))
            return
        mean = "mean_value: 104 mean_value: 117 mean_value: 123"
        self.data("data/ilsvrc12_train_lmdb", "data/ilsvrc12_val_lmdb", train_batch, test_batch,
                  f"mirror: true crop_size: {crop} {mean}", f"mirror: false crop_size: {crop} {mean}")

    def input(self, shape):
        dims = " ".join(f"dim: {d}" for d in shape)
        self.layer("data", "Input", top="data", inner=("input_param", [f"shape: {{ {dims} }}"]))

    def conv(self, name, bottom, num, kernel, stride=1, pad=0, group=1, weight="gaussian", std=0.01,
             bias=0.0, params=((1, 1), (2, 0)), bias_term=True):
        body = [f"num_output: {num}"]
        body += [f"pad: {pad}"] if pad else []
        body += [f"kernel_size: {kernel}"]
        body += [f"stride: {stride}"] if stride != 1 else []
        body += [f"group: {group}"] if group != 1 else []
        body += ["bias_term: false"] if not bias_term else []
        body.append(f"weight_filler {{ {filler(weight, std)} }}")
        if bias_term:
            body.append(f'bias_filler {{ type: "constant" value: {bias} }}')
        return self.layer(name, "Convolution", bottom, params=params if bias_term else params[:1],
                          inner=("convolution_param", body))

    def fc(self, name, bottom, num, weight="gaussian", std=0.005, bias=0.0, params=((1, 1), (2, 0))):
        body = [f"num_output: {num}", f"weight_filler {{ {filler(weight, std)} }}",
                f'bias_filler {{ type: "constant" value: {bias} }}']
        return self.layer(name, "InnerProduct", bottom, params=params, inner=("inner_product_param", body))

    def relu(self, name, bottom):
        return self.layer(name, "ReLU", bottom, top=bottom)

    def pool(self, name, bottom, method, kernel, stride, pad=0, global_pooling=False):
        body = [f"pool: {method}"]
        body += ["global_pooling: true"] if global_pooling else [f"kernel_size: {kernel}", f"stride: {stride}"]
        body += [f"pad: {pad}"] if pad else []
        return self.layer(name, "Pooling", bottom, inner=("pooling_param", body))

    def lrn(self, name, bottom, size, alpha, beta, region=None):
        body = [f"local_size: {size}", f"alpha: {alpha}", f"beta: {beta}"]
        body += [f"norm_region: {region}"] if region else []
        return self.layer(name, "LRN", bottom, inner=("lrn_param", body))

    def dropout(self, name, bottom, ratio):
        return self.layer(name, "Dropout", bottom, top=bottom, inner=("dropout_param", [f"dropout_ratio: {ratio}"]))

    def head(self, logits, loss_weight=None, accuracy=("accuracy",), loss="loss", top5=None):
        extra = f"  loss_weight: {loss_weight}\n" if loss_weight is not None else ""
        for name in accuracy:
            self.layer(name, "Accuracy", [logits, "label"], include="TEST")
        if top5:
            self.layer(top5, "Accuracy", [logits, "label"], include="TEST",
                       inner=("accuracy_param", ["top_k: 5"]))
        self.layer(loss, "SoftmaxWithLoss", [logits, "label"], extra=extra)

    def text(self):
        return "".join(self.lines)


def filler(kind, std):
    if kind == "gaussian":
        return f'type: "gaussian" std: {std}'
    if kind == "xavier":
        return 'type: "xavier"'
    if kind == "msra":
        return 'type: "msra"'
    raise ValueError(kind)


def write(folder, name, text):
    path = os.path.join(ROOT, folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as stream:
        stream.write(text)


def solver(net, **values):
    body = f'net: "models/{net}/train_val.prototxt"\n'
    for key, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                item = "true" if item else "false"
            elif isinstance(item, str) and key != "solver_mode":
                item = f'"{item}"'
            body += f"{key}: {item}\n"
    return body


# -- cifar10 (Caffe's examples/cifar10) ----------------------------------------

def cifar10(deploy, full):
    title = "cifar10_full" if full else "cifar10_quick"
    net = Net("CIFAR10_full" if full else "CIFAR10_quick",
              f"Caffe's examples/cifar10/{title}{'' if deploy else '_train_test'}.prototxt.")
    if deploy:
        net.input((1, 3, 32, 32))
    else:
        mean = 'mean_file: "data/cifar10_mean.binaryproto"'
        net.data("data/cifar10_train_lmdb", "data/cifar10_test_lmdb", 100, 100, mean, mean)
    x = net.conv("conv1", "data", 32, 5, pad=2, std=0.0001)
    x = net.pool("pool1", x, "MAX", 3, 2)
    net.relu("relu1", x)
    if full:
        x = net.lrn("norm1", x, 3, 5e-05, 0.75, "WITHIN_CHANNEL")
    x = net.conv("conv2", x, 32, 5, pad=2)
    net.relu("relu2", x)
    x = net.pool("pool2", x, "AVE", 3, 2)
    if full:
        x = net.lrn("norm2", x, 3, 5e-05, 0.75, "WITHIN_CHANNEL")
    x = net.conv("conv3", x, 64, 5, pad=2)
    net.relu("relu3", x)
    x = net.pool("pool3", x, "AVE", 3, 2)
    if full:
        x = net.fc("ip1", x, 10, std=0.01, params=((1, 250), (2, 0)))
    else:
        x = net.fc("ip1", x, 64, std=0.1)
        x = net.fc("ip2", x, 10, std=0.1)
    if deploy:
        net.layer("prob", "Softmax", x)
    else:
        net.head(x)
    return net.text()


# -- CaffeNet (BVLC reference, AlexNet variant: pool before norm) -------------

def caffenet(deploy):
    net = Net("CaffeNet", "BVLC reference CaffeNet (models/bvlc_reference_caffenet).")
    net.imagenet(deploy, 227, 256, 50)
    x = net.conv("conv1", "data", 96, 11, stride=4, std=0.01)
    net.relu("relu1", x)
    x = net.pool("pool1", x, "MAX", 3, 2)
    x = net.lrn("norm1", x, 5, 0.0001, 0.75)
    x = net.conv("conv2", x, 256, 5, pad=2, group=2, bias=1)
    net.relu("relu2", x)
    x = net.pool("pool2", x, "MAX", 3, 2)
    x = net.lrn("norm2", x, 5, 0.0001, 0.75)
    x = net.conv("conv3", x, 384, 3, pad=1)
    net.relu("relu3", x)
    x = net.conv("conv4", x, 384, 3, pad=1, group=2, bias=1)
    net.relu("relu4", x)
    x = net.conv("conv5", x, 256, 3, pad=1, group=2, bias=1)
    net.relu("relu5", x)
    x = net.pool("pool5", x, "MAX", 3, 2)
    x = net.fc("fc6", x, 4096, std=0.005, bias=1)
    net.relu("relu6", x)
    net.dropout("drop6", x, 0.5)
    x = net.fc("fc7", x, 4096, std=0.005, bias=1)
    net.relu("relu7", x)
    net.dropout("drop7", x, 0.5)
    x = net.fc("fc8", x, 1000, std=0.01)
    if deploy:
        net.layer("prob", "Softmax", x)
    else:
        net.head(x)
    return net.text()


# -- GoogLeNet (BVLC, with its two auxiliary classifiers) ----------------------

INCEPTION = {  # name: 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj
    "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128), "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}


def googlenet(deploy):
    net = Net("GoogleNet", "BVLC GoogLeNet (models/bvlc_googlenet), auxiliary classifiers in training.")
    net.imagenet(deploy, 224, 32, 50)

    def conv(name, bottom, num, kernel, stride=1, pad=0):
        x = net.conv(name, bottom, num, kernel, stride, pad, weight="xavier", bias=0.2)
        net.relu(name.split("/")[0] + "/relu_" + name.split("/")[-1], x)
        return x

    x = conv("conv1/7x7_s2", "data", 64, 7, 2, 3)
    x = net.pool("pool1/3x3_s2", x, "MAX", 3, 2)
    x = net.lrn("pool1/norm1", x, 5, 0.0001, 0.75)
    x = conv("conv2/3x3_reduce", x, 64, 1)
    x = conv("conv2/3x3", x, 192, 3, pad=1)
    x = net.lrn("conv2/norm2", x, 5, 0.0001, 0.75)
    x = net.pool("pool2/3x3_s2", x, "MAX", 3, 2)

    def inception(tag, bottom):
        a, b_red, b, c_red, c, d = INCEPTION[tag]
        prefix = f"inception_{tag}/"
        o1 = conv(prefix + "1x1", bottom, a, 1)
        o2 = conv(prefix + "3x3", conv(prefix + "3x3_reduce", bottom, b_red, 1), b, 3, pad=1)
        o3 = conv(prefix + "5x5", conv(prefix + "5x5_reduce", bottom, c_red, 1), c, 5, pad=2)
        pooled = net.pool(prefix + "pool", bottom, "MAX", 3, 1, pad=1)
        o4 = conv(prefix + "pool_proj", pooled, d, 1)
        return net.layer(prefix + "output", "Concat", [o1, o2, o3, o4])

    def auxiliary(index, bottom):
        prefix = f"loss{index}/"
        x = net.pool(prefix + "ave_pool", bottom, "AVE", 5, 3)
        x = conv(prefix + "conv", x, 128, 1)
        x = net.fc(prefix + "fc", x, 1024, weight="xavier", bias=0.2)
        net.relu(prefix + "relu_fc", x)
        net.dropout(prefix + "drop_fc", x, 0.7)
        x = net.fc(prefix + "classifier", x, 1000, weight="xavier", bias=0)
        net.layer(prefix + "loss", "SoftmaxWithLoss", [x, "label"], top=prefix + "loss" + str(index),
                  extra="  loss_weight: 0.3\n")
        net.layer(prefix + "top-1", "Accuracy", [x, "label"], include="TEST")
        net.layer(prefix + "top-5", "Accuracy", [x, "label"], include="TEST",
                  inner=("accuracy_param", ["top_k: 5"]))

    x = inception("3a", x)
    x = inception("3b", x)
    x = net.pool("pool3/3x3_s2", x, "MAX", 3, 2)
    x = inception("4a", x)
    if not deploy:
        auxiliary(1, x)
    x = inception("4b", x)
    x = inception("4c", x)
    x = inception("4d", x)
    if not deploy:
        auxiliary(2, x)
    x = inception("4e", x)
    x = net.pool("pool4/3x3_s2", x, "MAX", 3, 2)
    x = inception("5a", x)
    x = inception("5b", x)
    x = net.pool("pool5/7x7_s1", x, "AVE", 7, 1)
    if not deploy:
        net.dropout("pool5/drop_7x7_s1", x, 0.4)
    x = net.fc("loss3/classifier", x, 1000, weight="xavier", bias=0)
    if deploy:
        net.layer("prob", "Softmax", x)
    else:
        net.layer("loss3/loss3", "SoftmaxWithLoss", [x, "label"], top="loss3/loss3", extra="  loss_weight: 1\n")
        net.layer("loss3/top-1", "Accuracy", [x, "label"], include="TEST")
        net.layer("loss3/top-5", "Accuracy", [x, "label"], include="TEST",
                  inner=("accuracy_param", ["top_k: 5"]))
    return net.text()


# -- ResNet-18 (BatchNorm + Scale + Eltwise) -----------------------------------

def resnet18(deploy):
    net = Net("ResNet-18", "ResNet-18 (He et al. 2015) in Caffe's BatchNorm + Scale + Eltwise form.")
    net.imagenet(deploy, 224, 32, 25)

    def conv_bn(name, bottom, num, kernel, stride=1, pad=0, relu=True):
        x = net.conv(name, bottom, num, kernel, stride, pad, weight="msra", params=((1, 1),), bias_term=False)
        net.layer("bn_" + name, "BatchNorm", x, top=x,
                  extra="  param { lr_mult: 0 decay_mult: 0 }\n" * 3)
        net.layer("scale_" + name, "Scale", x, top=x, inner=("scale_param", ["bias_term: true"]))
        if relu:
            net.relu(name + "_relu", x)
        return x

    x = conv_bn("conv1", "data", 64, 7, 2, 3)
    x = net.pool("pool1", x, "MAX", 3, 2)
    channels = 64
    for stage, num in enumerate((64, 128, 256, 512), start=2):
        for unit in ("a", "b"):
            name = f"res{stage}{unit}"
            stride = 2 if unit == "a" and stage > 2 else 1
            if num != channels or stride != 1:
                shortcut = conv_bn(name + "_branch1", x, num, 1, stride, relu=False)
            else:
                shortcut = x
            y = conv_bn(name + "_branch2a", x, num, 3, stride, 1)
            y = conv_bn(name + "_branch2b", y, num, 3, 1, 1, relu=False)
            x = net.layer(name, "Eltwise", [shortcut, y])
            net.relu(name + "_relu", x)
            channels = num
    x = net.pool("pool5", x, "AVE", 0, 0, global_pooling=True)
    x = net.fc("fc1000", x, 1000, weight="msra", params=((1, 1), (2, 0)))
    if deploy:
        net.layer("prob", "Softmax", x)
    else:
        net.head(x, accuracy=("accuracy",), top5="accuracy_top5")
    return net.text()


def main():
    for folder, make in (("cifar10_quick", lambda d: cifar10(d, False)), ("cifar10_full", lambda d: cifar10(d, True)),
                         ("caffenet", caffenet), ("googlenet", googlenet), ("resnet18", resnet18)):
        write(folder, "train_val.prototxt", make(False))
        write(folder, "deploy.prototxt", make(True))
    write("cifar10_quick", "solver.prototxt", "# Caffe's cifar10_quick_solver.prototxt.\n" + solver(
        "cifar10_quick", test_iter=100, test_interval=500, base_lr=0.001, momentum=0.9, weight_decay=0.004,
        lr_policy="fixed", display=100, max_iter=4000, snapshot=4000, snapshot_prefix="output/cifar10_quick",
        solver_mode="CPU"))
    write("cifar10_full", "solver.prototxt", "# Caffe's cifar10_full_solver.prototxt.\n" + solver(
        "cifar10_full", test_iter=100, test_interval=1000, base_lr=0.001, momentum=0.9, weight_decay=0.004,
        lr_policy="fixed", display=200, max_iter=60000, snapshot=10000, snapshot_prefix="output/cifar10_full",
        solver_mode="CPU"))
    write("caffenet", "solver.prototxt", "# BVLC reference CaffeNet solver.\n" + solver(
        "caffenet", test_iter=1000, test_interval=1000, base_lr=0.01, lr_policy="step", gamma=0.1,
        stepsize=100000, display=20, max_iter=450000, momentum=0.9, weight_decay=0.0005, snapshot=10000,
        snapshot_prefix="output/caffenet", solver_mode="CPU"))
    write("googlenet", "solver.prototxt", "# BVLC GoogLeNet solver (quick schedule: poly).\n" + solver(
        "googlenet", test_iter=1000, test_interval=4000, test_initialization=False, display=40,
        average_loss=40, base_lr=0.01, lr_policy="poly", power=0.5, max_iter=2400000, momentum=0.9,
        weight_decay=0.0002, snapshot=40000, snapshot_prefix="output/googlenet", solver_mode="CPU"))
    write("resnet18", "solver.prototxt", "# ResNet-18: SGD 0.1, divided by 10 every 30 epochs of ImageNet.\n"
          + solver("resnet18", test_iter=2000, test_interval=5000, base_lr=0.1, lr_policy="multistep",
                   gamma=0.1, stepvalue=[150000, 300000, 450000], display=20, max_iter=600000, momentum=0.9,
                   weight_decay=0.0001, snapshot=50000, snapshot_prefix="output/resnet18", solver_mode="CPU"))


if __name__ == "__main__":
    main()
