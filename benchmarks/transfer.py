"""Transfer learning: does a backbone learned on Fashion-MNIST help on the 8x8 digits?

    python -m benchmarks.transfer --pretrain-steps 940 --steps 300 --train-examples 1437 100 30

Trains a `cnn` (default widths) on Fashion-MNIST; then, for each size of the digits' training
split (its first N examples), trains a new 10-class head on the digits on top of the frozen
Fashion-MNIST backbone, and the same head with the same steps and optimizer on the frozen
backbone of a randomly initialised `cnn` (random features). Prints both eval accuracies on the
digits' 360 eval images for each N, with the digits as they are (8x8) and framed like
Fashion-MNIST's images (each pixel 3x3, padded to 28x28): features learned at one scale serve
images of that scale.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import zoo

FRAMES = ("8x8", "28x28")


def framed(columns: dict[str, np.ndarray], frame: str) -> dict[str, np.ndarray]:
    """The digits as they are, or each pixel made 3x3 and the 24x24 image padded to 28x28."""
    if frame == "8x8":
        return columns
    big = np.kron(columns["image"], np.ones((1, 3, 3, 1), columns["image"].dtype))
    return {**columns, "image": np.pad(big, ((0, 0), (2, 2), (2, 2), (0, 0)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=940)  # two epochs, batch 128
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--train-examples", type=int, nargs="+", default=[1437, 100, 30])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    digits = zoo.load_data("digits")
    report: dict = {"settings": {k: str(v) for k, v in vars(args).items()}, "digits": {}}
    with tempfile.TemporaryDirectory() as scratch:
        pretrained = zoo.fit(
            "cnn",
            f"trainer.steps={args.pretrain_steps}",
            "trainer.eval_every=0",
            f"optimizer.warmup_steps={min(200, args.pretrain_steps // 5)}",
            f"workdir={scratch}/fashion",
        )
        report["fashion_mnist_accuracy"] = pretrained.eval_metrics["accuracy"]
        head = (
            f"trainer.steps={args.steps}",
            "trainer.batch_size=64",
            "optimizer.name=adam",
            "optimizer.schedule=constant",
            "optimizer.warmup_steps=0",
            f"optimizer.learning_rate={args.learning_rate}",
        )
        for frame in FRAMES:
            report["digits"][frame] = {}
            for n in args.train_examples:
                train = {name: column[:n] for name, column in digits.train.items()}
                data = zoo.Splits(
                    framed(train, frame), framed(digits.eval, frame), transform=digits.transform
                )
                transfer = zoo.finetune(
                    pretrained,
                    *head,
                    f"workdir={scratch}/transfer-{frame}-{n}",
                    data=data,
                    replace_head=True,
                    freeze="backbone",
                )
                random = zoo.finetune(
                    "cnn",
                    *head,
                    f"workdir={scratch}/random-{frame}-{n}",
                    data=data,
                    num_classes=10,
                    freeze="backbone",
                )
                report["digits"][frame][n] = {
                    "pretrained_backbone": transfer.eval_metrics["accuracy"],
                    "random_backbone": random.eval_metrics["accuracy"],
                }
                print(frame, n, report["digits"][frame][n], flush=True)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
