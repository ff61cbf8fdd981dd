"""Checkpoints of the PyTorch ecosystem in and out: a model-agnostic reader, filler and writer.

A pretrained directory holds `config.json` and the weights, either `model.safetensors` or
shards `*.safetensors` listed by `model.safetensors.index.json` (Hugging Face's layout, which
timm and torchvision exports share). Each model says which checkpoint families it loads by
registering a `train.registry.Family`: which `config.json` belongs to it, the hyper-parameters
it implies, and a table of `Rule`s from checkpoint keys to its params, with the transform of
each (transpose, split of a fused qkv, reshape to heads) and its inverse for export.

Reading needs no PyTorch: the `safetensors` library checks each file and lists its keys; each
tensor is then memory-mapped on its own, one at a time (bf16 as `ml_dtypes.bfloat16`), and the
rule's transform gives views of it. Every param is planned before it is filled: its sharding
gives each device a slice, and each distinct slice gets one page-aligned host buffer of the
param's dtype, into which the views are copied straight from the page cache (the only copy:
jax on CPU adopts a 64-byte-aligned numpy buffer as a device buffer without copying it, so the
slices become the devices' arrays through `jax.make_array_from_callback`). No device ever holds a
full copy of a sharded param, and the host holds the model and one mapped tensor at a time.

Everything is checked before the model changes: a key that no rule maps, a param no key fills,
a shape that differs, a directory of no registered family, a missing shard or a truncated file
each raise a `ZooError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from train.errors import ZooError, mismatches
from train.host_memory import page_buffer
from train.paths import matches
from train.registry import Family, Rule, families
from train.sharding import AxisRules

__all__ = [
    "Family",
    "Pretrained",
    "Rule",
    "export_tensors",
    "fill",
    "is_pretrained",
    "open_pretrained",
    "write_pretrained",
]

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
NewBuffer = Callable[[tuple[int, ...], Any], np.ndarray]
FILLED = (nnx.Param, nnx.BatchStat)
"""The variables a checkpoint holds: params and BatchNorm running statistics."""


def is_pretrained(directory: str | os.PathLike) -> bool:
    """Whether `directory` looks like a pretrained checkpoint (config.json + safetensors)."""
    root = os.fspath(directory)
    present = {
        name for name in (CONFIG, WEIGHTS, INDEX) if os.path.isfile(os.path.join(root, name))
    }
    return CONFIG in present and bool(present & {WEIGHTS, INDEX})


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """An opened pretrained directory: its `config.json`, its family, and where each key is."""

    directory: str
    config: Mapping[str, Any]
    family: Family
    files: Mapping[str, str]  # checkpoint key -> the safetensors file that holds it

    def hparams(self) -> dict[str, Any]:
        """The zoo model's constructor arguments this checkpoint implies."""
        return self.family.hparams(self.config)

    @property
    def tokenizer(self) -> str | None:
        """The directory's `tokenizer.json`, if it has one."""
        path = os.path.join(self.directory, TOKENIZER)
        return path if os.path.isfile(path) else None

    def loaded_elements(self) -> int:
        """How many numbers the model's params take from the checkpoint: every tensor's but
        those of keys its family ignores (from the files' headers)."""
        headers = {path: _header(path)[1] for path in set(self.files.values())}
        ignore = [re.compile(pattern) for pattern in self.family.ignore]
        return sum(
            math.prod(headers[path][key]["shape"])
            for key, path in self.files.items()
            if not any(pattern.fullmatch(key) for pattern in ignore)
        )

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(key, array) of every tensor, file by file: each a read-only view of the file's
        bytes, mapped for as long as it is referenced, so that a reader copies each straight
        into its own buffers (the library's `get_tensor` holds a second copy while it converts,
        and `load_file` the whole file besides the arrays)."""
        by_file: dict[str, list[str]] = {}
        for key, path in self.files.items():
            by_file.setdefault(path, []).append(key)
        for path, keys in by_file.items():
            start, header = _header(path)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for key in keys:
                    yield key, _mapped(f, size, start, header[key], f"{key} of {path}")


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _header(path: str) -> tuple[int, dict[str, Any]]:
    """(where the data start, the JSON header) of a safetensors file that `safe_open` read
    (so checked whole): an 8-byte little-endian length, then the header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def _mapped(f: Any, size: int, start: int, entry: Mapping[str, Any], what: str) -> np.ndarray:
    """The tensor `entry` of the open file `f` (of `size` bytes, data from `start`), mapped."""
    if entry["dtype"] not in _DTYPES:
        raise ZooError(
            f"Tensor {what} has dtype {entry['dtype']}, which zoo does not read; it reads "
            f"{', '.join(_DTYPES)}."
        )
    dtype, shape = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"])
    begin, end = (start + offset for offset in entry["data_offsets"])
    count = int(np.prod(shape))
    if end - begin != count * dtype.itemsize:
        raise ZooError(f"Tensor {what} holds {end - begin} bytes for shape {list(shape)}.")
    if end > size:
        raise ZooError(f"The file ends inside tensor {what}: it is truncated.")
    if count == 0:
        return np.empty(shape, dtype)
    first = begin - begin % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(f.fileno(), end - first, offset=first, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype, count, begin - first).reshape(shape)


def open_pretrained(directory: str | os.PathLike, model: str | None = None) -> Pretrained:
    """Open a pretrained directory of a registered family (of `model`'s, if given), checking its
    files: every shard present and readable, every key where the index says."""
    root = os.path.abspath(os.fspath(directory))
    if not is_pretrained(root):
        found = ", ".join(sorted(os.listdir(root))) if os.path.isdir(root) else "nothing"
        raise ZooError(
            f"{root} is not a pretrained checkpoint: it needs {CONFIG} and {WEIGHTS} (or shards "
            f"listed by {INDEX}), and holds {found}."
        )
    config = _read_json(os.path.join(root, CONFIG))
    return Pretrained(root, config, _family(root, config, model), _key_files(root))


def _family(root: str, config: Mapping[str, Any], model: str | None) -> Family:
    candidates = families(model)
    found = [f for f in candidates if f.matches(config)]
    if found:
        return found[0]
    known = "; ".join(f"{f.name} for {f.model} ({f.description})" for f in candidates) or "none"
    kind = ", ".join(
        f"{key} {config[key]!r}"
        for key in ("model_type", "architectures", "architecture")
        if key in config
    )
    wanted = f" of model '{model}'" if model else ""
    raise ZooError(
        f"The checkpoint in {root} (config.json says {kind or 'nothing of its kind'}) is of no "
        f"registered family"
        f"{wanted}. Families known: {known}."
    )


def _key_files(root: str) -> dict[str, str]:
    """Checkpoint key -> file, from the index of a sharded checkpoint or the single file."""
    index = os.path.join(root, INDEX)
    if not os.path.isfile(index):
        path = os.path.join(root, WEIGHTS)
        return {key: path for key in _keys(path)}
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ZooError(f"{index} has no 'weight_map' of keys to shard files.")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(root, s))]
    if missing:
        raise ZooError(
            f"The sharded checkpoint in {root} lacks shard(s) {', '.join(missing)} that "
            f"{INDEX} lists (of {len(shards)}): download the missing file(s) again."
        )
    files: dict[str, str] = {}
    for shard in shards:
        path = os.path.join(root, shard)
        listed = {k for k, s in weight_map.items() if s == shard}
        held = set(_keys(path))
        if listed - held:
            raise ZooError(
                f"Shard {path} lacks key(s) {', '.join(sorted(listed - held))} that {INDEX} "
                "places in it: the shard does not belong to this index."
            )
        files.update((key, path) for key in held)
    return files


def _keys(path: str) -> list[str]:
    with _opened(path) as f:
        return list(f.keys())


def _opened(path: str):
    try:
        return safe_open(path, framework="np")
    except SafetensorError as e:
        raise ZooError(
            f"Cannot read the safetensors file {path} ({e}): it is truncated or damaged; "
            "download it again."
        ) from None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ZooError(f"Cannot read {path} as JSON: {e}.") from None


def fill(
    model: nnx.Module,
    pretrained: Pretrained,
    *,
    hparams: Mapping[str, Any],
    skip: Sequence[str] = (),
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
    new_buffer: NewBuffer = page_buffer,
) -> list[str]:
    """Fill `model`'s params and BatchNorm statistics from the checkpoint, except those `skip`
    patterns match (a new head); returns the dotted paths skipped. Each array takes the
    sharding of the one it replaces; an abstract model (`nnx.eval_shape`) needs `mesh` and
    `rules`, which give each param the sharding of its logical axes. `new_buffer(shape, dtype)`
    gives the host buffers the devices adopt (`Prefaulted.take`: pages readied beforehand).
    Nothing changes unless every key maps, every param is filled and every shape agrees."""
    targets = _targets(model)
    skipped = [p for p in targets if any(matches(s, p) for s in skip)]
    table = pretrained.family.rules_for(hparams)
    stacked = tuple(pretrained.family.stacked(hparams))
    ignore = [re.compile(pattern) for pattern in pretrained.family.ignore]
    unmapped, absent, differ, filling = [], [], [], {}
    for key, tensor in pretrained.tensors():
        if any(pattern.fullmatch(key) for pattern in ignore):
            continue
        found = _rule_for(table, key)
        if found is None:
            unmapped.append(key)
            continue
        rule, paths = found
        for path, value in zip(paths, rule.load(tensor), strict=True):
            target, layer = _unstacked(path, stacked)
            if target in skipped:
                continue
            variable = targets.get(target)
            depth = None if variable is None or layer is None else variable.shape[0]
            if variable is None or (depth is not None and layer >= depth):
                absent.append(f"{path} (from {key})")
                continue
            shape = tuple(variable.shape[1:] if depth else variable.shape)
            read = (value.shape[0] + rule.pad_rows, *value.shape[1:]) if value.ndim else ()
            if read != shape:
                differ.append(f"{path} (from {key}: {value.shape}, model {shape})")
                continue
            if target not in filling:
                filling[target] = _Filling(
                    variable, _sharding(variable, target, mesh, rules), new_buffer
                )
            filling[target].write(value, layer)
    unfilled = [
        f"{target} (layer(s) {', '.join(map(str, missing))})"
        for target, param in filling.items()
        if (missing := param.missing())
    ]
    unfilled += [p for p in targets if p not in filling and p not in skipped]
    _refuse(pretrained, unmapped, absent, differ, unfilled)
    for path, param in filling.items():
        targets[path].set_value(param.placed())
    return skipped


def _targets(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Dotted path -> variable of what a checkpoint fills; a LoRA-wrapped layer's params under
    their path without the wrapper's `base_module`, its adapters left out."""
    return {
        ".".join(str(part) for part in path if part != "base_module"): variable
        for path, variable in nnx.to_flat_state(nnx.state(model, FILLED))
        if not isinstance(variable, nnx.LoRAParam)
    }


def _unstacked(path: str, stacked: Sequence[str]) -> tuple[str, int | None]:
    """(param path, layer) of a rule's per-layer path `<prefix>.<i>.<rest>` when `prefix` is
    stacked (`<prefix>.<rest>`, slice i); else (`path`, None)."""
    for prefix in stacked:
        match = re.fullmatch(rf"{re.escape(prefix)}\.(\d+)\.(.+)", path)
        if match:
            return f"{prefix}.{match[2]}", int(match[1])
    return path, None


def _rule_for(table: Sequence[Rule], key: str) -> tuple[Rule, list[str]] | None:
    for rule in table:
        match = re.fullmatch(rule.key, key)
        if match:
            return rule, [match.expand(path) for path in rule.params]
    return None


def _sharding(variable: Any, path: str, mesh: Mesh | None, rules: Any) -> jax.sharding.Sharding:
    """The sharding of the array that replaces `variable`'s: its own, or (abstract) that of its
    logical axes."""
    current = variable.get_value()
    if isinstance(current, jax.Array):
        return current.sharding
    logical = variable.get_metadata().get("out_sharding")
    spec = () if logical is None else rules.spec(logical, tuple(variable.shape), mesh, f"'{path}'")
    return NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


class _Filling:
    """One param while the checkpoint fills it: a host buffer for each distinct slice that its
    sharding gives a device (one for a replicated param), which jax on CPU adopts as the
    device's buffer, and which layers of a stacked param are in."""

    def __init__(self, variable: Any, sharding: jax.sharding.Sharding, new_buffer: NewBuffer):
        self.shape, self.dtype, self.sharding = tuple(variable.shape), variable.dtype, sharding
        self.new_buffer = new_buffer
        self.slices = {
            _bounds(index, self.shape)
            for index in sharding.addressable_devices_indices_map(self.shape).values()
        }
        self.buffers: dict[tuple, np.ndarray] = {}
        self.layers: set[int | None] = set()

    def write(self, value: np.ndarray, layer: int | None) -> None:
        """Copy `value` (a view of the tensor; slice `layer` of a stacked param) into every
        device's buffer; rows the param has beyond `value`'s are zero."""
        self.layers.add(layer)
        for bounds in self.slices:
            buffer = self.buffers.get(bounds)
            if buffer is None:
                shape = tuple(stop - start for start, stop in bounds)
                buffer = self.buffers[bounds] = self.new_buffer(shape, self.dtype)
            if layer is None:
                _copy_slice(buffer, value, bounds)
            elif bounds[0][0] <= layer < bounds[0][1]:
                _copy_slice(buffer[layer - bounds[0][0]], value, bounds[1:])

    def missing(self) -> list[int]:
        """The layers of a stacked param that no tensor filled."""
        if None in self.layers:
            return []
        return sorted(set(range(self.shape[0])) - self.layers)

    def placed(self) -> jax.Array:
        return jax.make_array_from_callback(
            self.shape, self.sharding, lambda index: self.buffers[_bounds(index, self.shape)]
        )


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device's index into an array of `shape` as hashable (start, stop) per axis."""
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def _copy_slice(buffer: np.ndarray, value: np.ndarray, bounds: tuple[tuple[int, int], ...]):
    """`buffer` = `value`[bounds] in `buffer`'s dtype, zero where the bounds pass `value`'s
    rows (padded rows)."""
    if not bounds:
        np.copyto(buffer, value, casting="unsafe")
        return
    (start, stop), rest = bounds[0], tuple(slice(*b) for b in bounds[1:])
    held = max(0, min(stop, len(value)) - start)
    np.copyto(buffer[:held], value[(slice(start, start + held), *rest)], casting="unsafe")
    buffer[held:] = 0


def _refuse(pretrained: Pretrained, unmapped, absent, differ, unfilled) -> None:
    problems = mismatches(
        ("checkpoint key(s) that map to no param", unmapped),
        ("param(s) that the model lacks", absent),
        ("shape(s) that differ", differ),
        ("param(s) that no checkpoint key fills", unfilled),
    )
    if problems:
        raise ZooError(
            f"Cannot load the {pretrained.family.name} checkpoint in {pretrained.directory} into "
            f"'{pretrained.family.model}': {problems}. The checkpoint does not "
            "fit the model its config.json implies; check that the directory holds one "
            "checkpoint, whole (or name new params to start fresh in finetune.reinit)."
        )


def export_tensors(
    model: nnx.Module, family: Family, hparams: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The model's params as the family's checkpoint keys (the rules' inverse). Every param must
    be exported by some rule: a model with adapters is merged first."""
    state = _per_layer(_targets(model), tuple(family.stacked(hparams)))
    tensors: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for rule in family.rules_for(hparams):
        pattern = _template_regex(rule.params[0])
        for path in state:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            groups = match.groups()
            paths = [_substitute(p, groups) for p in rule.params]
            arrays = [state[p] for p in paths]
            key = _substitute(rule.export_key or rule.key, groups)
            saved = rule.save(*arrays)
            if rule.pad_rows:
                saved = saved[: -rule.pad_rows]
            tensors[key] = np.ascontiguousarray(saved)
            used.update(paths)
    left = [path for path in state if path not in used]
    if left:
        raise ZooError(
            f"Cannot export to the {family.name} layout: no rule of its table writes "
            f"param(s) {', '.join(left)}."
        )
    return tensors


def _per_layer(targets: Mapping[str, Any], stacked: Sequence[str]) -> dict[str, np.ndarray]:
    """Path -> host array of every param, a stacked param split into `<prefix>.<i>.<rest>`."""
    host = {}
    for path, variable in targets.items():
        value = np.asarray(jax.device_get(variable[...]))
        prefix = next((p for p in stacked if path.startswith(f"{p}.")), None)
        if prefix is None:
            host[path] = value
            continue
        rest = path[len(prefix) + 1 :]
        host.update((f"{prefix}.{i}.{rest}", layer) for i, layer in enumerate(value))
    return host


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\\(\d+)", template)
    regex = "".join(re.escape(p) if i % 2 == 0 else "([^.]+)" for i, p in enumerate(parts))
    return re.compile(regex)


def _substitute(template: str, groups: Sequence[str]) -> str:
    return re.sub(r"\\(\d+)", lambda m: groups[int(m[1]) - 1], template)


def write_pretrained(
    out_dir: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]
) -> str:
    """Write `config.json` and `model.safetensors` into `out_dir`; returns its path."""
    root = os.path.abspath(os.fspath(out_dir))
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, CONFIG), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
    save_file(dict(tensors), os.path.join(root, WEIGHTS), metadata={"format": "pt"})
    return root
