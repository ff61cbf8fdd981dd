"""PyTorch (CPU) twins of the zoo's xor, mlp and cnn models, and their training loop.

Same architecture, initialiser families (LeCun-normal dense kernels, He-normal convolutions, zero
biases), BatchNorm momentum, Dropout rates, optimizer and learning rate, on the same batches.
PyTorch is optional (the CPU build of `torch`, installed by hand): `torch_loop` returns the
reason it cannot run instead of a loop when it is missing or the model has no twin.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Advance = Callable[[int], None]


def _twin(name: str, hparams: Mapping[str, Any]):
    from torch import nn

    def lecun(layer: nn.Linear | nn.Conv2d, he: bool = False) -> nn.Module:
        fan_in = math.prod(layer.weight.shape[1:])
        std = math.sqrt((2.0 if he else 1.0) / fan_in) / 0.87962566103423978  # truncated normal
        nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)
        return layer

    if name == "xor":
        hidden = int(hparams["num_hidden"])
        return nn.Sequential(
            lecun(nn.Linear(int(hparams["num_inputs"]), hidden)),
            nn.Tanh(),
            lecun(nn.Linear(hidden, int(hparams["num_outputs"]))),
        )
    if name == "mlp":
        sizes = [math.prod(hparams["input_shape"]), *hparams["hidden_sizes"]]
        layers: list[nn.Module] = [nn.Flatten()]
        for din, dout in itertools.pairwise(sizes):
            layers += [lecun(nn.Linear(din, dout)), nn.ReLU(), nn.Dropout(hparams["dropout_rate"])]
        return nn.Sequential(*layers, lecun(nn.Linear(sizes[-1], hparams["num_classes"])))
    if name == "cnn":
        height, width, channels = hparams["input_shape"]
        widths = [channels, *hparams["channels"]]
        layers = []
        for i, (cin, cout) in enumerate(itertools.pairwise(widths)):
            stride = 1 if i == 0 else 2
            conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            # Flax's BatchNorm momentum 0.9 keeps 90% of the old statistic: PyTorch's 0.1.
            layers += [lecun(conv, he=True), nn.BatchNorm2d(cout, momentum=0.1), nn.ReLU()]
            if i:
                height, width = -(-height // 2), -(-width // 2)
        features = height * width * widths[-1]
        return nn.Sequential(
            *layers,
            nn.Flatten(),
            nn.Dropout(hparams["dropout_rate"]),
            lecun(nn.Linear(features, hparams["num_classes"])),
        )
    raise KeyError(name)


TWINS = ("xor", "mlp", "cnn")


def torch_loop(
    name: str,
    hparams: Mapping[str, Any],
    optimizer: Mapping[str, Any],
    batches: list[Mapping[str, np.ndarray]],
) -> Advance | str:
    """A PyTorch training loop over `batches` (host arrays), or why there is none."""
    if name not in TWINS:
        return f"no PyTorch twin of model '{name}'"
    try:
        import torch
        from torch import nn
    except ImportError:
        return "PyTorch is not installed (pip install torch, the CPU build)"
    torch.manual_seed(0)
    model = _twin(name, hparams).train()
    update = torch_update(model, optimizer)
    if name == "xor":
        inputs = [torch.from_numpy(np.asarray(b["inputs"])) for b in batches]
        targets = [torch.from_numpy(np.asarray(b["label"], np.float32))[:, None] for b in batches]
        loss_fn: nn.Module = nn.BCEWithLogitsLoss()
    else:
        # Channels-last images -> PyTorch's channels-first, once, outside the timed loop.
        inputs = [
            torch.from_numpy(np.asarray(b["image"])).permute(0, 3, 1, 2).contiguous()
            for b in batches
        ]
        targets = [torch.from_numpy(np.asarray(b["label"], np.int64)) for b in batches]
        loss_fn = nn.CrossEntropyLoss()
    cycle = itertools.cycle(list(zip(inputs, targets, strict=True)))

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = next(cycle)
            loss_fn(model(x), y).backward()
            update()

    threads = fastest_threads(torch, steps)

    def advance(n: int) -> None:
        torch.set_num_threads(threads)
        steps(n)

    advance.threads = threads  # type: ignore[attr-defined]
    return advance


def torch_update(
    model: Any, optimizer: Mapping[str, Any], fused: bool = False
) -> Callable[[], None]:
    """The twin of the `optimizer` config section for `model`, as `update()`: clip the
    gradients to `grad_clip_norm` (if set), apply them, clear them. AdamW decays only the weights
    of Linear and Conv layers, like zoo's mask, unless `decay_all`. `fused`: PyTorch's fused
    Adam(W) kernels, its fastest."""
    import torch
    from torch import nn

    lr = float(optimizer["learning_rate"])
    if optimizer["name"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=float(optimizer["momentum"]))
    elif optimizer["name"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=fused)
    else:
        kernels = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)}
        rate = float(optimizer["weight_decay"])
        split: dict[bool, list] = {True: [], False: []}
        for p in model.parameters():
            split[bool(optimizer["decay_all"]) or id(p) in kernels].append(p)
        groups = [
            {"params": group, "weight_decay": rate if decayed else 0.0}
            for decayed, group in split.items()
            if group
        ]
        opt = torch.optim.AdamW(groups, lr=lr, fused=fused)
    clip = optimizer.get("grad_clip_norm")
    params = list(model.parameters())

    def update() -> None:
        if clip is not None:
            nn.utils.clip_grad_norm_(params, float(clip))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return update


def fastest_threads(torch: Any, steps: Advance, trial_steps: int = 20) -> int:
    """PyTorch's faster intra-op thread count for this model: one thread or all cores. On a
    small model its default (all cores) can be ten times slower than one thread."""
    timings = {}
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        steps(trial_steps)  # warm-up
        start = time.perf_counter()
        steps(trial_steps)
        timings[threads] = time.perf_counter() - start
    return min(timings, key=timings.get)
