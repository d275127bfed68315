#!/usr/bin/python3
"""Reads an evenstep checkpoint with h5py alone: no evenstep code, no pickle.

    from evenstep_ckpt_reader import load, model_state_dict, optimizer_state_dict
    tensors, extras = load("runs/fortunes/ckpt")          # the newest committed, or a step-* dir
    model.load_state_dict(model_state_dict(tensors))
    optimizer.load_state_dict(optimizer_state_dict(tensors, optimizer))

Returns {name: tensor} (torch tensors when torch is importable, numpy arrays
otherwise; bfloat16 without torch comes back as its raw uint16 words) and the
manifest's extras. It checks what evenstep's own reader checks: every
invariant of the manifest (tiling, offsets, bounds, canonical names, the index
checksum), regular files only (no symbolic link is followed), each HDF5
dataset's offset, size and dtype against the manifest, and every slice's
XXH3-64 (the `xxhash` module, Debian: python3-xxhash). CheckpointError names
the file and entry otherwise.

    evenstep_ckpt_reader.py CKPT                 prints name, dtype, shape
    evenstep_ckpt_reader.py CKPT --dump DIR      writes each tensor's raw bytes to DIR
"""
import json
import math
import os
import re
import stat
import sys

import h5py
import numpy as np

NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
         "bfloat16": np.uint16, "int8": np.int8, "int16": np.int16, "int32": np.int32,
         "int64": np.int64, "uint8": np.uint8, "bool": np.bool_}
SIZE = {k: np.dtype(v).itemsize for k, v in NUMPY.items()}
# The HDF5 type evenstep writes for each dtype, as h5py shows it (little-endian
# on disk whatever the host; bool as uint8, bfloat16 as its uint16 words).
STORED = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2",
          "int8": "|i1", "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "|u1",
          "bool": "|u1"}
MAX_MANIFEST_BYTES = 256 << 20
MAX_JSON_DEPTH = 64
STEP_DIR = re.compile(r"^step-[0-9]{10,19}$")


class CheckpointError(ValueError):
    """A checkpoint that breaks the format (the message names file and entry)."""


def _regular_file(path):
    """lstat: a regular file (not a symbolic link, FIFO or device); its size."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError("%s: missing" % path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError("%s: not a regular file (evenstep reads regular files only)" % path)
    return st.st_size


def resolve(path):
    """A checkpoint directory: `path` itself when it holds manifest.json, else
    the newest committed checkpoint under `path` (by manifest, as evenstep's
    resume chooses; `latest` is only a hint and is never followed)."""
    if os.path.lexists(os.path.join(path, "manifest.json")):
        return path
    steps = [n for n in os.listdir(path) if STEP_DIR.match(n) and
             "step-%010d" % int(n[5:]) == n and
             os.path.lexists(os.path.join(path, n, "manifest.json"))]
    if not steps:
        raise CheckpointError("%s: no committed checkpoint" % path)
    return os.path.join(path, max(steps, key=lambda n: int(n[5:])))


def _depth(text):
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _not_json(name):
    """Python's json reads NaN, Infinity and -Infinity; JSON (and evenstep) does not."""
    raise ValueError("%s is not a JSON value" % name)


def _finite(text):
    """A JSON number as the C++ reader takes it: one that overflows a double
    (1e999, which Python would read as inf) is an error, not Infinity."""
    v = float(text)
    if math.isinf(v):
        raise ValueError("the number %s is out of range" % text)
    return v


def index_text(m):
    """The canonical index text whose XXH3-64 is the manifest's index_xxh3."""
    lines = ["evenstep-checkpoint-index\t%d" % m["version"], "step\t%d" % m["step"],
             "world_size\t%d" % m["world_size"]]
    for i, (name, size) in enumerate(zip(m["shards"], m["shard_bytes"])):
        lines.append("shard\t%d\t%s\t%d" % (i, name, size))
    for t in m["tensors"]:
        lines.append("tensor\t%s\t%s\t%s" % (t["name"], t["dtype"], ",".join(str(d) for d in t["shape"])))
        for s in t["slices"]:
            lines.append("slice\t%d\t%s\t%d\t%d\t%d\t%d\t%s" % (
                s["shard"], s["dataset"], s["begin"], s["end"], s["offset"], s["bytes"], s["xxh3"]))
    return "".join(line + "\n" for line in lines)


def _int(obj, key, lo=0, hi=(1 << 63) - 1):
    v = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CheckpointError("\"%s\" = %r is not an integer in [%d, %d]" % (key, v, lo, hi))
    return v


def check_train_extras(extras):
    """What a resume refuses in the extras (evenstep::CheckTrainExtras, the
    same rules): a problem string, or None."""
    if not isinstance(extras, dict):
        return "extras: not a JSON object"
    if "balance" not in extras:
        if "user" in extras:  # a TrainCheckpointer's checkpoint always has it
            return 'extras: the balancing state ("balance") is missing; a resume refuses it'
        return None
    b = extras["balance"]
    if b is None:
        return None
    why = "manifest extras: balance state: "
    if not isinstance(b, dict):
        return why + "not an object"
    def integer(k):
        v = b.get(k)
        return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v <= 1 << 62
    if not all(integer(k) for k in ("epoch", "step", "num_samples", "steps")):
        return why + "epoch, step, num_samples and steps must be integers"
    seed = b.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        return why + "seed must be a non-negative integer"
    if "global_batch" in b and (not integer("global_batch") or b["global_batch"] <= 0 or
                                b.get("batch_unit") not in ("samples", "tokens")):
        return why + "global_batch must be a positive integer with batch_unit samples or tokens"
    def fractions(v):
        if not isinstance(v, list) or not v or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or
                not math.isfinite(x) or x < 0 for x in v):
            return False
        return abs(sum(v) - 1) <= 1e-6
    if not fractions(b.get("shares")):
        return why + "shares %s: must be non-negative numbers that sum to 1" % (
            json.dumps(b["shares"]) if "shares" in b else "missing")
    if "stream_shares" in b and not fractions(b["stream_shares"]):
        return why + "stream_shares %s: must be non-negative numbers that sum to 1" % (
            json.dumps(b["stream_shares"]))
    caps = b.get("memory_caps", [])
    if not isinstance(caps, list):
        return why + "memory_caps must be an array"
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in caps):
        return why + "a memory cap is not a non-negative integer"
    return None


def validate(m, path, files=True):
    """Every invariant of the format (README: the checkpoint format), as the
    C++ reader checks them; with `files`, also that each shard is a regular
    file of the size the manifest says (stat'ed once its name is known to be
    canonical). Raises CheckpointError naming the entry."""
    def bad(why):
        raise CheckpointError("%s: %s" % (os.path.join(path, "manifest.json"), why))
    if not isinstance(m, dict) or m.get("format") != "evenstep-checkpoint":
        bad("not an evenstep manifest")
    try:
        version = _int(m, "version")
        if version not in (1, 2):
            bad("format version %d (this reader reads 1 and 2)" % version)
        step, world = _int(m, "step"), _int(m, "world_size", 1, 1 << 20)
        shards, sizes = m.get("shards"), m.get("shard_bytes")
        if not isinstance(shards, list) or not isinstance(sizes, list) or \
                len(shards) != world or len(sizes) != world:
            bad("world_size %d with %r shards" % (world, shards))
        for i, (name, size) in enumerate(zip(shards, sizes)):
            if name != "shard-%05d-of-%05d.h5" % (i, world):
                bad("shard %d is named %r" % (i, name))
            if not isinstance(size, int) or size < 0:
                bad("shard_bytes of shard %d is %r" % (i, size))
            if files:
                on_disk = _regular_file(os.path.join(path, name))
                if on_disk != size:
                    bad("%s: %d bytes, the manifest says %d" % (name, on_disk, size))
        base = os.path.basename(os.path.normpath(path))
        if STEP_DIR.match(base) and int(base[5:]) != step:
            bad("step %d in the directory of step %d" % (step, int(base[5:])))
        names, ranges = set(), [[] for _ in range(world)]
        for t in m.get("tensors", None) or []:
            name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
            if not isinstance(name, str) or not name or name.startswith("/") or \
                    any(ord(c) < 0x20 or c in "@\\\x7f" for c in name) or \
                    any(seg in ("", ".", "..") for seg in name.split("/")):
                bad("tensor name %r" % (name,))
            if name in names:
                bad("tensor %s appears twice" % name)
            names.add(name)
            if dtype not in SIZE:
                bad("tensor %s: unknown dtype %r" % (name, dtype))
            if not isinstance(shape, list) or len(shape) > 64 or \
                    any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
                bad("tensor %s: shape %r" % (name, shape))
            numel = 1
            for d in shape:
                numel *= d
            if numel * 16 >= 1 << 63:
                bad("tensor %s: impossible shape" % name)
            slices = t.get("slices")
            if not isinstance(slices, list) or not slices:
                bad("tensor %s: no slices" % name)
            covered = 0
            for s in slices:
                shard, begin, end = _int(s, "shard", 0, world - 1), _int(s, "begin"), _int(s, "end")
                offset, nbytes = _int(s, "offset", -1), _int(s, "bytes")
                if not isinstance(s.get("xxh3"), str) or not re.match(r"^[0-9a-f]{16}$", s["xxh3"]):
                    bad("tensor %s: xxh3 %r" % (name, s.get("xxh3")))
                grows = end > begin or (numel == 0 and len(slices) == 1)
                if begin != covered or not grows or end > numel or nbytes != (end - begin) * SIZE[dtype]:
                    bad("tensor %s: slice [%d, %d) does not continue at %d of %d" %
                        (name, begin, end, covered, numel))
                want = "/" + name if len(slices) == 1 else "/%s@%d" % (name, begin)
                if s.get("dataset") != want:
                    bad("tensor %s: dataset %r, the format names it %r" % (name, s.get("dataset"), want))
                if (nbytes == 0) != (offset == -1):
                    bad("tensor %s: offset %d with %d bytes" % (name, offset, nbytes))
                if nbytes and offset + nbytes > sizes[shard]:
                    bad("tensor %s: bytes [%d, %d) outside %s" % (name, offset, offset + nbytes, shards[shard]))
                if nbytes:
                    ranges[shard].append((offset, offset + nbytes, name))
                covered = end
            if covered != numel:
                bad("tensor %s: slices cover %d of %d elements" % (name, covered, numel))
        for r, spans in enumerate(ranges):
            spans.sort()
            for a, b in zip(spans, spans[1:]):
                if b[0] < a[1]:
                    bad("tensors %s and %s overlap in %s" % (a[2], b[2], shards[r]))
        problem = check_train_extras(m.get("extras", {}))
        if problem:
            bad(problem)
        if version >= 2:
            try:
                import xxhash
            except ImportError:
                xxhash = None
            if xxhash is not None:
                computed = "%016x" % xxhash.xxh3_64_intdigest(index_text(m).encode())
                if computed != m.get("index_xxh3"):
                    bad("index checksum %r does not match its tensor index (%s)" %
                        (m.get("index_xxh3"), computed))
    except CheckpointError as e:
        if str(e).startswith(path):  # already names its file (the manifest or a shard)
            raise
        bad("malformed: %s" % e)
    except (TypeError, AttributeError, KeyError) as e:
        bad("malformed: %r" % e)


def load(path, as_torch=None):
    path = resolve(path)
    manifest_path = os.path.join(path, "manifest.json")
    if _regular_file(manifest_path) > MAX_MANIFEST_BYTES:
        raise CheckpointError("%s: larger than %d bytes" % (manifest_path, MAX_MANIFEST_BYTES))
    with open(manifest_path, "rb") as f:
        text = f.read().decode("utf-8")
    if _depth(text) > MAX_JSON_DEPTH:
        raise CheckpointError("%s: JSON nested deeper than %d" % (manifest_path, MAX_JSON_DEPTH))
    try:
        manifest = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except ValueError as e:
        raise CheckpointError("%s: not JSON: %s" % (manifest_path, e))
    validate(manifest, path)
    shard_paths = [os.path.join(path, s) for s in manifest["shards"]]
    try:
        import xxhash
    except ImportError:
        xxhash = None
        print("evenstep_ckpt_reader: python3-xxhash is not installed: checksums NOT verified",
              file=sys.stderr)
    shards = []
    for p in shard_paths:
        try:
            shards.append(h5py.File(p, "r"))
        except OSError as e:  # h5py's message does not name the file
            for f in shards:
                f.close()
            raise CheckpointError("%s: not a readable HDF5 file (%s)" % (p, e))
    out = {}
    for t in manifest["tensors"]:
        count = int(np.prod(t["shape"], dtype=np.int64))
        flat = np.empty(count, dtype=NUMPY[t["dtype"]])
        for s in t["slices"]:
            where = "%s, dataset %s" % (manifest["shards"][s["shard"]], s["dataset"])
            if s["bytes"] == 0:
                continue
            ds = shards[s["shard"]].get(s["dataset"])
            if not isinstance(ds, h5py.Dataset):
                raise CheckpointError("%s: missing from the HDF5 file" % where)
            if ds.id.get_offset() != s["offset"] or ds.id.get_storage_size() != s["bytes"] or \
                    ds.attrs.get("dtype") not in (t["dtype"], t["dtype"].encode()):
                raise CheckpointError("%s: the HDF5 dataset (offset %s, %d bytes, dtype %r) is not "
                                      "what the manifest says (offset %d, %d bytes, dtype %s)" %
                                      (where, ds.id.get_offset(), ds.id.get_storage_size(),
                                       ds.attrs.get("dtype"), s["offset"], s["bytes"],
                                       t["dtype"]))
            # What verify checks too: the stored type (not relabelled, not
            # big-endian) and the dataset's shape (the tensor's for a whole
            # tensor, the slice's length for a slice).
            want_shape = tuple(t["shape"]) if len(t["slices"]) == 1 else (s["end"] - s["begin"],)
            if ds.dtype.str != STORED[t["dtype"]] or ds.shape != want_shape:
                raise CheckpointError("%s: the HDF5 dataset is %s %s, the manifest says %s %s" %
                                      (where, ds.dtype.str, list(ds.shape), t["dtype"],
                                       list(want_shape)))
            data = np.ascontiguousarray(ds[...]).view(flat.dtype).reshape(-1)
            if data.size != s["end"] - s["begin"]:
                raise CheckpointError("%s: %d elements, the manifest says %d" %
                                      (where, data.size, s["end"] - s["begin"]))
            if xxhash is not None and xxhash.xxh3_64_intdigest(data.tobytes()) != int(s["xxh3"], 16):
                raise CheckpointError("%s: checksum mismatch" % where)
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
            if t["dtype"] == "bfloat16":
                # torch 1.13 has no uint16: the same bits as int16, viewed as bfloat16.
                tensor = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(array.copy())
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
    try:
        tensors, extras = load(sys.argv[1], as_torch=False)
    except CheckpointError as e:
        print("evenstep_ckpt_reader: %s" % e, file=sys.stderr)
        return 1
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
