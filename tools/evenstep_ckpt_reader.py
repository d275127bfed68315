#!/usr/bin/python3
"""Reads an evenstep checkpoint with h5py alone: no evenstep code, no pickle.

    from evenstep_ckpt_reader import load, model_state_dict, optimizer_state_dict
    tensors, extras = load("runs/fortunes/ckpt")          # the latest, or a step-* dir
    model.load_state_dict(model_state_dict(tensors))
    optimizer.load_state_dict(optimizer_state_dict(tensors, optimizer))

Returns {name: tensor} (torch tensors when torch is importable, numpy arrays
otherwise; bfloat16 without torch comes back as its raw uint16 words) and the
manifest's extras. Every slice's XXH3-64 is checked when the `xxhash` module
is installed (Debian: python3-xxhash).

    evenstep_ckpt_reader.py CKPT                 prints name, dtype, shape
    evenstep_ckpt_reader.py CKPT --dump DIR      writes each tensor's raw bytes to DIR
"""
import json
import os
import sys

import h5py
import numpy as np

NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
         "bfloat16": np.uint16, "int8": np.int8, "int16": np.int16, "int32": np.int32,
         "int64": np.int64, "uint8": np.uint8, "bool": np.bool_}


def resolve(path):
    """A checkpoint directory: `path` itself, or the one `path/latest` names."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    with open(os.path.join(path, "latest")) as f:
        return os.path.join(path, f.read().strip())


def load(path, as_torch=None):
    path = resolve(path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != "evenstep-checkpoint" or manifest.get("version") != 1:
        raise ValueError("%s: not an evenstep checkpoint of format version 1" % path)
    try:
        import xxhash
    except ImportError:
        xxhash = None
    shards = [h5py.File(os.path.join(path, os.path.basename(s)), "r") for s in manifest["shards"]]
    out = {}
    for t in manifest["tensors"]:
        count = int(np.prod(t["shape"], dtype=np.int64))
        flat = np.empty(count, dtype=NUMPY[t["dtype"]])
        for s in t["slices"]:
            data = shards[s["shard"]][s["dataset"]][...]
            data = np.ascontiguousarray(data).view(flat.dtype).reshape(-1)
            if xxhash is not None and xxhash.xxh3_64_intdigest(data.tobytes()) != int(s["xxh3"], 16):
                raise ValueError("%s, dataset %s: checksum mismatch" % (manifest["shards"][s["shard"]], s["dataset"]))
            flat[s["begin"]:s["end"]] = data
        out[t["name"]] = flat.reshape(t["shape"])
    for f in shards:
        f.close()
    if as_torch is None:
        try:
            import torch  # noqa: F401
            as_torch = True
        except ImportError:
            as_torch = False
    if as_torch:
        import torch
        converted = {}
        for t in manifest["tensors"]:
            array = out[t["name"]]
            tensor = torch.from_numpy(array.copy())
            if t["dtype"] == "bfloat16":
                tensor = tensor.view(torch.bfloat16)
            converted[t["name"]] = tensor
        out = converted
    return out, manifest.get("extras", {})


def model_state_dict(tensors, prefix="model/"):
    """The model's parameters and buffers, named as in `module.state_dict()`."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def optimizer_state_dict(tensors, optimizer):
    """`optimizer.state_dict()` with the checkpoint's learning rates and
    per-parameter state (exp_avg, momentum_buffer, step, ...: libtorch and
    torch.optim use the same names), for `optimizer.load_state_dict`.
    Parameter i of group g of the C++ optimizer is parameter i of group g of
    `optimizer`: build it over the same parameters in the same order
    (`model.parameters()` of the same architecture)."""
    import torch
    sd = optimizer.state_dict()
    groups = sd["param_groups"]
    def fits(parts):  # optimizer/G/lr or optimizer/G/I/FIELD within the groups
        if len(parts) == 3 and parts[2] == "lr":
            return int(parts[1]) < len(groups)
        return (len(parts) == 4 and int(parts[1]) < len(groups)
                and int(parts[2]) < len(groups[int(parts[1])]["params"]))

    for name in tensors:
        parts = name.split("/")
        if parts[0] == "optimizer" and not fits(parts):
            raise ValueError("%s: the optimizer has %d parameter groups of %s parameters" %
                             (name, len(groups), [len(g["params"]) for g in groups]))
    for g, group in enumerate(groups):
        lr = tensors.get("optimizer/%d/lr" % g)
        if lr is not None:
            group["lr"] = float(lr)
        for i, index in enumerate(group["params"]):
            prefix = "optimizer/%d/%d/" % (g, i)
            fields = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if "step" in fields:  # torch.optim keeps the step count as a float tensor
                fields["step"] = torch.as_tensor(fields["step"]).to(torch.float32)
            if fields:
                sd["state"][index] = fields
    return sd


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    tensors, extras = load(sys.argv[1], as_torch=False)
    if len(sys.argv) == 4 and sys.argv[2] == "--dump":
        os.makedirs(sys.argv[3], exist_ok=True)
        for name, array in tensors.items():
            with open(os.path.join(sys.argv[3], name.replace("/", "__") + ".bin"), "wb") as f:
                f.write(np.ascontiguousarray(array).tobytes())
    for name, array in tensors.items():
        print(name, array.dtype, list(array.shape))
    print("extras", json.dumps(extras))
    return 0


if __name__ == "__main__":
    sys.exit(main())
