"""Checkpoints of the PyTorch ecosystem in and out: a model-agnostic reader, filler and writer.

A pretrained directory holds `config.json` and the weights, either `model.safetensors` or
shards `*.safetensors` listed by `model.safetensors.index.json` (Hugging Face's layout, which
timm and torchvision exports share). Each model says which checkpoint families it loads by
registering a `zoo.engine.registry.Family`: which `config.json` belongs to it, the hyper-parameters
it implies, and a table of `Rule`s from checkpoint keys to its params, with the transform of
each (transpose, split of a fused qkv, reshape to heads) and its inverse for export.

Reading needs no PyTorch: the `safetensors` library checks each file and lists its keys; each
tensor is then memory-mapped on its own (bf16 as `ml_dtypes.bfloat16`), and the rule's
transform gives views of it. Every param is planned before it is filled: its sharding cuts it
into one block per distinct device shard, and one host buffer of the param's dtype holds this
process's blocks, each 64-byte aligned, into which the views are copied straight from the page
cache, in one copy per tensor through a view of the buffer with the param's axes (the only
copy: jax on CPU adopts a 64-byte-aligned numpy buffer as a device buffer without copying it, so
the blocks become the devices' arrays through `jax.make_array_from_callback`). No device ever
holds a full copy of a sharded param, and the host holds the model and one mapped tensor at a
time while it copies.

A quantized checkpoint whose family declares how its tensors combine (`Combine`: gpt-oss's
MXFP4 experts, blocks and scales) is read as the tensors the rules map: each is decoded, into
the dtype of the params it fills, only when it is copied, after the other tensors and one at a
time, so that the host holds one decoded tensor besides the model.

Everything is checked before the model changes (`plan_fill`): a key that no rule maps, a param
no key fills, a shape that differs, a directory of no registered family, a missing shard or a
truncated file each raise a `ZooError` naming what is wrong. The copies then need no model, so
a caller may run them on a thread while it does other work (`PlannedFill.copied_meanwhile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import mmap
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from zoo.engine.errors import ZooError, mismatches
from zoo.engine.registry import Combine, Family, Rule, families
from zoo.engine.sharding.mesh import AxisRules, variable_sharding
from zoo.engine.weights.host_memory import page_buffer
from zoo.engine.weights.lora import filled
from zoo.engine.weights.paths import matches

__all__ = [
    "Family",
    "PlannedFill",
    "Pretrained",
    "Rule",
    "export_tensors",
    "fill",
    "is_pretrained",
    "open_pretrained",
    "plan_fill",
    "write_pretrained",
]

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
NewBuffer = Callable[[tuple[int, ...], Any], np.ndarray]
FILLED = (nnx.Param, nnx.BatchStat)
"""The variables a checkpoint holds: params and BatchNorm running statistics."""
log = logging.getLogger("zoo")
_SWITCH_INTERVAL = 1e-4
"""Seconds: how long a thread waits for the GIL before it asks the holder to let go."""
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that copy a checkpoint's tensors into the params' buffers."""


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
    combined: Mapping[str, _Parts] = dataclasses.field(default_factory=dict)
    """Tensor key -> its stored parts, for a quantized checkpoint's (`Family.combine`)."""

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
        those of keys its family ignores (from the files' headers), a tensor stored in parts
        counted as decoded."""
        headers = {path: _header(path)[1] for path in set(self.files.values())}
        ignore = [re.compile(pattern) for pattern in self.family.ignore_for(self.hparams())]
        parts = {key for combined in self.combined.values() for key in combined.keys}
        stored = sum(
            math.prod(headers[path][key]["shape"])
            for key, path in self.files.items()
            if key not in parts and not any(pattern.fullmatch(key) for pattern in ignore)
        )
        return stored + sum(math.prod(combined.shape) for combined in self.combined.values())

    def tensors(self, dtype: Any = np.float32) -> Iterator[tuple[str, np.ndarray]]:
        """(key, array) of every tensor, file by file: each a read-only view of the file's
        bytes (`stored`), a quantized one decoded into `dtype`, one at a time."""
        for key, tensor in self.stored():
            yield key, tensor.decode(dtype) if isinstance(tensor, _Encoded) else tensor

    def stored(self) -> Iterator[tuple[str, np.ndarray | _Encoded]]:
        """(key, tensor) of every tensor: a mapped view of the file, or, for a tensor stored in
        parts (`combined`), its parts mapped (`_Encoded`), once the last is. A view stays mapped
        for as long as it is referenced, so that a reader copies each straight into its own
        buffers (the library's `get_tensor` holds a second copy while it converts, and
        `load_file` the whole file besides the arrays)."""
        part_of = {
            part: (key, combined)
            for key, combined in self.combined.items()
            for part in combined.keys
        }
        held: dict[str, dict[str, np.ndarray]] = {}
        for key, array in self._views():
            if key not in part_of:
                yield key, array
                continue
            whole, combined = part_of[key]
            parts = held.setdefault(whole, {})
            parts[key] = array
            if len(parts) == len(combined.keys):
                del held[whole]
                yield whole, _Encoded(combined, tuple(parts[part] for part in combined.keys))

    def _views(self) -> Iterator[tuple[str, np.ndarray]]:
        """(key, a read-only view of the file's bytes) of every stored tensor, file by file."""
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


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A tensor stored in parts: how they combine, their keys (in `combine.parts`' order) and
    the tensor's shape."""

    combine: Combine
    keys: tuple[str, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """A tensor stored in parts, mapped and not yet decoded."""

    parts: _Parts
    arrays: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parts.shape

    def decode(self, dtype: Any) -> np.ndarray:
        return self.parts.combine.decode(*self.arrays, dtype=dtype)

    def placeholder(self) -> np.ndarray:
        """An array of the tensor's shape that holds no memory (every element the one zero), for
        the rules' transforms to give the shapes of their views before anything is decoded."""
        return np.broadcast_to(np.zeros((), np.float32), self.shape)


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
    family = _family(root, config, model)
    config = {**config, **_sidecars(root, family)}
    _warn_unaccounted(root, family, config)
    files = _key_files(root)
    return Pretrained(root, config, family, files, _combined(root, family, config, files))


def _combined(
    root: str, family: Family, config: Mapping[str, Any], files: Mapping[str, str]
) -> dict[str, _Parts]:
    """Tensor key -> its parts, for the tensors stored in parts that the family combines under
    the config's quantization method: each part present and the parts' shapes fitting
    (`ZooError` naming the keys otherwise)."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    combines = [combine for combine in family.combine if combine.quant_method == method]
    found: dict[str, Combine] = {}
    for key in files:
        for combine in combines:
            for part in combine.parts:
                whole = key.removesuffix(part)
                if whole != key and re.fullmatch(combine.key, whole):
                    found.setdefault(whole, combine)
    if not found:
        return {}
    headers = {path: _header(path)[1] for path in set(files.values())}
    return {
        whole: _parts_of(root, method, whole, combine, files, headers)
        for whole, combine in found.items()
    }


def _parts_of(
    root: str,
    method: str,
    whole: str,
    combine: Combine,
    files: Mapping[str, str],
    headers: Mapping[str, Mapping[str, Any]],
) -> _Parts:
    """The parts of the tensor `whole`, checked: each present, none beside a stored `whole`,
    and their shapes and dtypes as `combine` takes them."""
    keys = tuple(whole + part for part in combine.parts)
    missing = [key for key in keys if key not in files]
    what = f"The {method} checkpoint in {root}"
    if missing:
        held = ", ".join(key for key in keys if key in files)
        raise ZooError(
            f"{what} holds {held} without {', '.join(missing)}: {whole} is stored as "
            f"{' and '.join(keys)}, together. Download the checkpoint again, whole."
        )
    if whole in files:
        raise ZooError(
            f"{what} holds both {whole} and its {method} parts {', '.join(keys)}: it must "
            "hold one or the other."
        )
    entries = [headers[files[key]][key] for key in keys]
    specs = [(tuple(e["shape"]), np.dtype(_DTYPES.get(e["dtype"], np.void))) for e in entries]
    try:
        shape = combine.shape(*specs)
    except ValueError as e:
        stored = ", ".join(f"{key} {list(spec[0])} {spec[1]}" for key, spec in zip(keys, specs))
        raise ZooError(f"{what} cannot be read: {whole} ({stored}) does not fit: {e}.") from None
    return _Parts(combine, keys, tuple(shape))


def _sidecars(root: str, family: Family) -> dict[str, Any]:
    """The family's other JSON files that `root` holds, each under its file's stem."""
    paths = {os.path.splitext(name)[0]: os.path.join(root, name) for name in family.sidecars}
    return {stem: _read_json(path) for stem, path in paths.items() if os.path.isfile(path)}


_WARNED: set[tuple[str, str]] = set()
"""(directory, keys) already warned about: a load opens its directory more than once."""


def _warn_unaccounted(root: str, family: Family, config: Mapping[str, Any]) -> None:
    """One warning naming the keys of the checkpoint's config that its family neither honours
    nor knows to be inert (once per directory and keys in a process)."""
    found = family.unaccounted(config)
    named = ", ".join(f"{key}={value!r}" for key, value in found.items())
    if not found or (root, named) in _WARNED:
        return
    _WARNED.add((root, named))
    log.warning(
        "The %s checkpoint in %s has config key(s) that zoo does not know: %s. They are "
        "ignored, and may change what the model computes: compare its outputs with the "
        "library that wrote it.",
        family.name,
        root,
        named,
    )


def _family(root: str, config: Mapping[str, Any], model: str | None) -> Family:
    candidates = families(model)
    found = [f for f in candidates if (model or f.by_default) and f.matches(config)]
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


def fill(model: nnx.Module, pretrained: Pretrained, **planning: Any) -> list[str]:
    """Fill `model`'s params and BatchNorm statistics from the checkpoint (`planning`: the
    keywords of `plan_fill`); returns the dotted paths skipped. Nothing changes unless every
    key maps, every param is filled and every shape agrees."""
    planned = plan_fill(model, pretrained, **planning)
    planned.copy()
    return planned.place()


@dataclasses.dataclass
class PlannedFill:
    """A fill checked and planned: each param's host buffer, and the copies into it. `copy` needs
    no model and holds the GIL only between copies, so it may run on a thread of its own while
    the caller does other work; `place` then hands the buffers to the model."""

    targets: dict[str, Any]
    fillings: dict[str, _Filling]
    skipped: list[str]
    ready: Callable[[], None]
    decodings: list[_Decoding] = dataclasses.field(default_factory=list)

    def copy(self) -> None:
        """Every planned copy, param by param on `_COPY_THREADS` threads, once the buffers are
        `ready` (each tensor's mapping is let go once the params it fills are copied, so the
        host holds at most a tensor of the file per thread). numpy copies without the GIL, and
        one thread alone copies at well under the memory's speed. Then the tensors stored in
        parts, one at a time: each decoded, copied and let go before the next is decoded, so
        that the host never holds two."""
        self.ready()
        fillings = list(self.fillings.values())
        with ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="zoo-copy") as pool:
            for copied in [pool.submit(filling.copy) for filling in fillings]:
                copied.result()
        decodings, self.decodings = self.decodings, []
        for decoding in decodings:
            decoding.copy()

    @contextlib.contextmanager
    def copied_meanwhile(self) -> Iterator[None]:
        """`copy` on a thread of its own while the body runs (and done when it ends). Python's
        switch interval is shortened meanwhile: between two copies the thread needs the GIL for a
        moment, and while the body runs Python it would wait up to the default 5 ms each time."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="zoo-fill") as pool:
                copied = pool.submit(self.copy)
                yield
                copied.result()
        finally:
            sys.setswitchinterval(interval)

    def place(self) -> list[str]:
        """Set each param to its copied buffers; returns the dotted paths skipped."""
        for path, filling in self.fillings.items():
            self.targets[path].set_value(filling.placed())
        return self.skipped


def plan_fill(
    model: nnx.Module,
    pretrained: Pretrained,
    *,
    hparams: Mapping[str, Any],
    skip: Sequence[str] = (),
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
    new_buffer: NewBuffer = page_buffer,
    ready: Callable[[], None] = lambda: None,
) -> PlannedFill:
    """`fill` up to its copies: every key matched to its param, every shape checked (a
    `ZooError` naming each problem), each param's buffer taken and its copies planned.

    Params that `skip` patterns match (a new head) are left as they are. Each array takes the
    sharding of the one it replaces; an abstract model (`nnx.eval_shape`) needs `mesh` and
    `rules`, which give each param the sharding of its logical axes. `new_buffer(shape, dtype)`
    gives the host buffers the devices adopt, which may be written once `ready()` returns
    (`Prefaulted.take` and `Prefaulted.wait`: pages faulted in meanwhile)."""
    targets = _targets(model)
    skipped = [p for p in targets if any(matches(s, p) for s in skip)]
    table = pretrained.family.rules_for(hparams)
    stacked = tuple(pretrained.family.stacked(hparams))
    ignore = [re.compile(pattern) for pattern in pretrained.family.ignore_for(hparams)]
    unmapped, absent, differ, filling = [], [], [], {}
    decodings: list[_Decoding] = []
    for key, tensor in pretrained.stored():
        if any(pattern.fullmatch(key) for pattern in ignore):
            continue
        found = _rule_for(table, key)
        if found is None:
            unmapped.append(key)
            continue
        rule, paths = found
        encoded = tensor if isinstance(tensor, _Encoded) else None
        decoding = None if encoded is None else _Decoding(encoded, rule)
        views = rule.load(tensor if encoded is None else encoded.placeholder())
        for index, (path, value) in enumerate(zip(paths, views, strict=True)):
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
                    variable, variable_sharding(variable, target, mesh, rules), new_buffer
                )
            if decoding is None:
                filling[target].plan(value, layer)
            else:
                decoding.fills(index, filling[target], layer)
        if decoding is not None and decoding.consumers:
            decodings.append(decoding)
    unfilled = [
        f"{target} (layer(s) {', '.join(map(str, missing))})"
        for target, param in filling.items()
        if (missing := param.missing())
    ]
    unfilled += [p for p in targets if p not in filling and p not in skipped]
    _refuse(pretrained, unmapped, absent, differ, unfilled)
    return PlannedFill(targets, filling, skipped, ready, decodings)


def _targets(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Dotted path -> variable of what a checkpoint fills; a LoRA-wrapped layer's params under
    their path without the wrapper's `base_module`, its adapters left out (see `lora.filled`)."""
    return {".".join(map(str, path)): variable for path, variable in filled(model, FILLED)}


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


class _Filling:
    """One param while the checkpoint fills it. Its sharding cuts it into equal blocks, one per
    distinct device shard (one for a replicated param); one host buffer holds the blocks this
    process's devices need, each 64-byte aligned, which jax on CPU adopts as those devices'
    buffers without a copy. When the blocks tile a box of the param (always, on one process),
    a tensor is copied into all of them at once, through a view of the buffer with the param's
    axes; otherwise (a layer of a stacked param) block by block."""

    def __init__(self, variable: Any, sharding: jax.sharding.Sharding, new_buffer: NewBuffer):
        self.shape, self.sharding = tuple(variable.shape), sharding
        indices = sharding.addressable_devices_indices_map(self.shape).values()
        self.blocks = sorted({_bounds(index, self.shape) for index in indices})
        self.position = {bounds: n for n, bounds in enumerate(self.blocks)}
        self.block_shape = tuple(stop - start for start, stop in self.blocks[0])
        dtype = np.dtype(variable.dtype)
        size = math.prod(self.block_shape)
        stride = -(-size * dtype.itemsize // _ALIGN) * _ALIGN // dtype.itemsize
        self.buffer = new_buffer((len(self.blocks), stride), dtype)
        self.grid = _grid(self.blocks, self.block_shape, self.buffer, size)
        self.copies: list[tuple[Callable[..., Any], tuple]] = []
        self.layers: set[int | None] = set()

    def block(self, n: int) -> np.ndarray:
        return self.buffer[n, : math.prod(self.block_shape)].reshape(self.block_shape)

    def plan(self, value: np.ndarray, layer: int | None) -> None:
        """Plan the copy of `value` (a view of the tensor; slice `layer` of a stacked param) into
        every block; rows the param has beyond `value`'s are zero."""
        self.layers.add(layer)
        if layer is None and self.grid is not None:
            self.copies.append((_copy_box, (*self.grid, value)))
            return
        for n, bounds in enumerate(self.blocks):
            if layer is None:
                self.copies.append((_copy_slice, (self.block(n), value, bounds)))
            elif bounds[0][0] <= layer < bounds[0][1]:
                block = self.block(n)[layer - bounds[0][0]]
                self.copies.append((_copy_slice, (block, value, bounds[1:])))

    def copy(self) -> None:
        copies, self.copies = self.copies, []
        while copies:
            function, args = copies.pop(0)
            function(*args)

    def missing(self) -> list[int]:
        """The layers of a stacked param that no tensor filled."""
        if None in self.layers:
            return []
        return sorted(set(range(self.shape[0])) - self.layers)

    def placed(self) -> jax.Array:
        return jax.make_array_from_callback(
            self.shape,
            self.sharding,
            lambda index: self.block(self.position[_bounds(index, self.shape)]),
        )


class _Decoding:
    """A tensor stored in parts and the params its rule fills from it: decoded when copied, in
    the params' dtype, and let go once they are filled."""

    def __init__(self, tensor: _Encoded, rule: Rule):
        self.tensor: _Encoded | None = tensor
        self.rule = rule
        self.consumers: list[tuple[int, _Filling, int | None]] = []

    def fills(self, index: int, filling: _Filling, layer: int | None) -> None:
        """Plan that the rule's `index`-th array fills `filling` (slice `layer` of it)."""
        self.consumers.append((index, filling, layer))
        filling.layers.add(layer)

    def copy(self) -> None:
        tensor, self.tensor = self.tensor, None
        dtype = np.result_type(*(filling.buffer.dtype for _, filling, _ in self.consumers))
        views = self.rule.load(tensor.decode(dtype))
        for index, filling, layer in self.consumers:
            filling.plan(views[index], layer)
            filling.copy()


_ALIGN = 64
"""The alignment at which jax on CPU adopts a host buffer instead of copying it."""


def _grid(blocks, block_shape, buffer, size) -> tuple[np.ndarray, tuple[slice, ...]] | None:
    """(the buffer viewed with the param's axes, each split into (block, within block), and the
    box of the param that it holds) when `blocks` tile a box in row-major order and sit
    unpadded in `buffer`; else None."""
    if buffer.shape[1] != size:
        return None
    starts = [sorted({bounds[axis][0] for bounds in blocks}) for axis in range(len(block_shape))]
    counts = [len(axis) for axis in starts]
    if math.prod(counts) != len(blocks) or any(
        axis != list(range(axis[0], axis[0] + n * step, step))
        for axis, n, step in zip(starts, counts, block_shape, strict=True)
    ):
        return None
    rank = len(block_shape)
    view = buffer.reshape(*counts, *block_shape)
    view = view.transpose([i for axis in range(rank) for i in (axis, rank + axis)])
    box = tuple(
        slice(axis[0], axis[0] + n * step)
        for axis, n, step in zip(starts, counts, block_shape, strict=True)
    )
    return view, box


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device's index into an array of `shape` as hashable (start, stop) per axis."""
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def _copy_box(view: np.ndarray, box: tuple[slice, ...], value: np.ndarray) -> None:
    """`view` (a `_grid` view) = `value`[box], zero in the rows past `value`'s (padded rows):
    one copy, or one per block of the first axis when rows are padded."""
    if not box:
        np.copyto(view, value, casting="unsafe")
        return
    rows, rest = box[0], box[1:]
    if rows.stop <= len(value):
        np.copyto(view, value[box].reshape(view.shape), casting="unsafe")
        return
    size = view.shape[1]
    for i, block in enumerate(view):
        start = rows.start + i * size
        held = max(0, min(size, len(value) - start))
        part = value[(slice(start, start + held), *rest)]
        np.copyto(block[:held], part.reshape(held, *block.shape[1:]), casting="unsafe")
        block[held:] = 0


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


DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
"""The dtypes a checkpoint is written in, by the names transformers gives them."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def write_pretrained(
    out_dir: str | os.PathLike,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    sidecars: Sequence[str] = (),
) -> str:
    """Write `config.json` and the weights into `out_dir`; returns its path.

    Floating-point tensors are written in `dtype` (`float32` or `bfloat16`, rounded to nearest;
    the config's `dtype` and `torch_dtype` name it where the config is transformers'). Above
    `max_shard_size` (bytes, or transformers' strings: `"5GB"`, `"200MiB"`), the tensors are
    split, in order, into shards `model-0000i-of-0000n.safetensors` that
    `model.safetensors.index.json` lists, as transformers' `save_pretrained(max_shard_size=...)`
    writes them. `sidecars`: file names (`preprocessor_config.json`) whose content the config
    holds under the file's stem, written as files of their own."""
    if dtype not in DTYPES:
        raise ZooError(f"dtype={dtype!r}: checkpoints are written in {' or '.join(DTYPES)}.")
    limit = None if max_shard_size is None else _bytes(max_shard_size)
    root = os.path.abspath(os.fspath(out_dir))
    os.makedirs(root, exist_ok=True)
    config = dict(config)
    for name in sidecars:
        stem = os.path.splitext(name)[0]
        if stem in config:
            _write_json(os.path.join(root, name), config.pop(stem))
    if "model_type" in config:  # transformers 5 reads `dtype`; before 4.56, `torch_dtype`
        config["dtype"] = config["torch_dtype"] = dtype
    cast = {key: _cast(array, DTYPES[dtype]) for key, array in tensors.items()}
    for stale in os.listdir(root):  # the weights of an earlier export into the same directory
        if stale in (WEIGHTS, INDEX) or _SHARD.fullmatch(stale):
            os.remove(os.path.join(root, stale))
    _write_json(os.path.join(root, CONFIG), config)
    shards = _shards(cast, limit)
    if len(shards) == 1:
        save_file(cast, os.path.join(root, WEIGHTS), metadata={"format": "pt"})
        return root
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, os.path.join(root, name), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in cast.values())},
        "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
    }
    _write_json(os.path.join(root, INDEX), index)
    return root


def _bytes(size: int | str) -> int:
    """A shard size in bytes: an int, or a number and a unit as transformers writes them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if match is None or float(match[1]) <= 0:
        raise ZooError(
            f"max_shard_size={size!r} is not a size: give bytes (an int) or a number and a unit, "
            "e.g. '200MB', '5GB', '2GiB'."
        )
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])


def _cast(array: np.ndarray, dtype: Any) -> np.ndarray:
    if not np.issubdtype(array.dtype, np.floating) and array.dtype != ml_dtypes.bfloat16:
        return array
    return np.ascontiguousarray(array.astype(dtype))


def _shards(tensors: Mapping[str, np.ndarray], limit: int | None) -> list[dict[str, np.ndarray]]:
    """The tensors in order, a new shard begun where the next would pass `limit` bytes (a
    tensor larger than `limit` has a shard of its own), as transformers splits them."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, array in tensors.items():
        if limit is not None and shards[-1] and size + array.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = array
        size += array.nbytes
    return shards


def _write_json(path: str, content: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, sort_keys=True)
