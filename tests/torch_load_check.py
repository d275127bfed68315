#!/usr/bin/python3
"""Loads a checkpoint of tests/ckpt_helper.cc into PyTorch objects with
tools/evenstep_ckpt_reader.py (no evenstep code), reads every tensor back out
of the torch model and optimizer under evenstep's names and prints the digest
ckpt_helper prints: XXH64 over (name, raw bytes) in name order.

    torch_load_check.py CKPT_DIR adam|sgd
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import torch  # noqa: E402
import xxhash  # noqa: E402
from evenstep_ckpt_reader import load, model_state_dict, optimizer_state_dict  # noqa: E402


class Scale(torch.nn.Module):  # ckpt_helper's Scale: a buffer, no parameters
    def __init__(self, n):
        super().__init__()
        self.register_buffer("scale", torch.zeros(n))

    def forward(self, x):
        return x * self.scale


def main():
    ckpt, kind = sys.argv[1], sys.argv[2]
    torch.manual_seed(7)  # other values than the checkpoint's: the load must overwrite them
    model = torch.nn.Sequential(torch.nn.Linear(4, 300), torch.nn.Tanh(), Scale(300),
                                torch.nn.Linear(300, 1))
    params = list(model.parameters())
    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    tensors, _ = load(ckpt)
    model.load_state_dict(model_state_dict(tensors))  # strict: every name and shape
    optimizer.load_state_dict(optimizer_state_dict(tensors, optimizer))

    named = {"model/" + k: v for k, v in model.state_dict().items()}
    sd = optimizer.state_dict()
    for g, group in enumerate(sd["param_groups"]):
        named["optimizer/%d/lr" % g] = torch.tensor(group["lr"], dtype=torch.float64)
        for i, index in enumerate(group["params"]):
            for field, value in sd["state"].get(index, {}).items():
                if field == "step":  # evenstep stores the count as int64
                    value = torch.tensor(int(value), dtype=torch.int64)
                named["optimizer/%d/%d/%s" % (g, i, field)] = value
    h = xxhash.xxh64(seed=0)
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().contiguous().numpy().tobytes())
    print("torch", torch.__version__)
    print("digest %016x (%d tensors)" % (h.intdigest(), len(named)))
    # An optimizer over fewer parameters is an error naming a tensor.
    try:
        optimizer_state_dict(tensors, torch.optim.SGD(params[:1], lr=0.1))
        print("mismatch not detected")
    except ValueError as e:
        print("mismatch named:", str(e).split(":")[0])


if __name__ == "__main__":
    main()
