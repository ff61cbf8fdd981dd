"""One step of reward fine-tuning (`finetune.method=grpo`) on Qwen3-0.6B's architecture: where
its time goes (sampling, scoring, the update), how fast it samples against zoo's decoding of the
same batch, and its peak memory.

    python -m benchmarks.grpo_step --repeats 3 --json runs/bench/grpo_step.json
    python -m benchmarks.grpo_step --tiny        # a 2-layer decoder: seconds, for a test

The checkpoint: `benchmarks.decoder_costs`' random Qwen3-0.6B weights (made once, in a child
process, so that this process's peak memory is the run's own; no download), with the chat
template and byte-level BPE tokenizer of the tiny Qwen3 chat fixture (tests/fixtures/pretrained/
qwen3-chat: 384 ids, all within Qwen3's vocabulary of 151,936) and its end-of-turn ids. `--tiny`
runs on that fixture itself.

The run is zoo's own: a `Trainer` of `finetune.init_from=DIR finetune.method=grpo data=prompts`
(`--prompts` prompts a step, `--generations` completions each, at most `--completion-tokens`
tokens, LoRA of `--lora-rank` on every attention and MLP projection, 0: every param trained;
rewards `numeric_match` and `format`), one device, driven step by step through
`Trainer.steps()`. A warm-up step compiles everything; then `--repeats` steps are timed, each
finished (`block_until_ready` on the train state) before the next begins:

- rollout: the policy's `sample` call (`zoo.models.sampling_loop.sample_completions`, wrapped):
  a `Session` made for the batch, the prefill, one decode step per token, drawn at temperature
  1 with no filter, the host reading every token (it returns host lists, so its time is the
  device's);
- scoring: the rest of the step's batch (`Trainer._next_batches`, timed until its arrays are
  ready): the next prompts read, the completions decoded to text, the reward functions, the
  group advantages, the batch assembled and placed on the device;
- update: from there until the train state is ready: the jitted train step's dispatch and
  work, and the loop's bookkeeping around it (probes off, no eval, no checkpoint in the timed
  steps).

Rollout tokens/s: the completion tokens written (an end-of-turn id may end a row early) over
the rollout's seconds. Beside it, `benchmarks.decode`'s figures for the same batch (the step's
prompts, each repeated `--generations` times): a `Session` of `benchmarks.decode.CONTEXT` slots
on the policy as the rollout samples it (LoRA adapters in place, the run's precision), greedy,
`--completion-tokens` new tokens, made afresh after each step and called once to warm; decode
tokens/s is the tokens after the first over the time after it, and the whole call's figure is
every new token over the call. The comparison runs in the same process, interleaved with the
steps; every figure is a median over the repeats.

Peak memory: the process's peak resident memory (`VmHWM`) once the first timed step is done,
before the comparison makes a session (with it, at the end, as a second figure); on a device
that keeps allocator statistics (a GPU), the device's peak bytes in use at the same two points.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import decode
from benchmarks.decoder_costs import CONFIG, WEIGHTS
from benchmarks.pretrained_loading import CACHE, peak_resident_bytes

ROOT = Path(__file__).resolve().parents[1]
CHAT_FIXTURE = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat"
CHAT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The chat fixture's ids that replace the Qwen3 config's (theirs lie outside its tokenizer)."""
ROWS = 40
"""Prompts in the benchmark's file: `What is i plus j?` with the answer."""
PHASES = ("rollout", "scoring", "update")


def chat_checkpoint(cache: Path) -> Path:
    """Qwen3-0.6B's random weights (made in a child process where missing) with the chat
    fixture's tokenizer, template and special ids, in a directory of its own."""
    weights = cache / "qwen3-0.6b-random"
    if not (weights / WEIGHTS).is_file():
        code = "import sys; from pathlib import Path; from benchmarks.decoder_costs import "
        code += "make_checkpoint; make_checkpoint(Path(sys.argv[1]))"
        subprocess.run([sys.executable, "-c", code, str(weights)], cwd=ROOT, check=True)
    directory = cache / "qwen3-0.6b-random-chat"
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / WEIGHTS).exists():
        os.symlink(weights / WEIGHTS, directory / WEIGHTS)
    fixture = json.loads((CHAT_FIXTURE / "config.json").read_text())
    config = {**CONFIG, **{key: fixture[key] for key in SPECIAL_IDS}}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in CHAT_FILES:
        shutil.copyfile(CHAT_FIXTURE / name, directory / name)
    return directory


def prompt_file(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} plus {i + 7}?", "answer": str(2 * i + 7)} for i in range(ROWS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def overrides(checkpoint: Path, data: Path, args: argparse.Namespace, workdir: str) -> list[str]:
    """The run: the warm-up step, the timed ones, and one more that is never run (the last step
    saves a checkpoint; the loop is closed before it)."""
    lora = [f"finetune.lora_rank={args.lora_rank}"]
    lora += ["finetune.lora_layers=layers"] if args.lora_rank else []
    return [
        f"finetune.init_from={checkpoint}",
        "finetune.method=grpo",
        "finetune.grpo.rewards=[numeric_match,format]",
        f"finetune.grpo.num_generations={args.generations}",
        f"finetune.grpo.max_completion_length={args.completion_tokens}",
        *lora,
        f"model.context_length={decode.CONTEXT}",
        "data=prompts",
        f"data.path={data}",
        "data.eval_fraction=0.2",
        "data.eval_replies=0",
        f"trainer.batch_size={args.prompts}",
        f"trainer.steps={args.repeats + 2}",
        "trainer.log_every=1000",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        "logging.norms_every=0",
        f"workdir={workdir}",
    ]


class StepClock:
    """The trainer's batch of completions timed from inside: its `sample` call and the rest of
    `_next_batches`; the prompts the last rollout sampled from."""

    def __init__(self, trainer: Any):
        self.seconds: dict[str, float] = {}
        self.tokens, self.prompts, self.ready, self.width = 0, [], 0.0, 0
        batches = trainer.rollout_batches
        sample = batches.rollouts.sample

        def timed_sample(model, prompts, max_new_tokens, sampling, key, eos):
            start = time.perf_counter()
            done = sample(model, prompts, max_new_tokens, sampling, key, eos)
            self.seconds["rollout"] = time.perf_counter() - start
            self.tokens, self.prompts = sum(len(new) for new, _ in done), list(prompts)
            return done

        batches.rollouts = dataclasses.replace(batches.rollouts, sample=timed_sample)
        next_batches = trainer._next_batches

        def timed_batches(iterator, step):
            start = time.perf_counter()
            batch = jax.block_until_ready(next_batches(iterator, step))
            self.ready = time.perf_counter()
            self.seconds["scoring"] = self.ready - start - self.seconds["rollout"]
            self.width = batch["tokens"].shape[1]
            return batch

        trainer._next_batches = timed_batches

    def step(self, steps: Iterator[int], trainer: Any) -> dict[str, float]:
        """The next step run to its end: its phases' seconds and the tokens it sampled."""
        next(steps)
        jax.block_until_ready(trainer.state)
        update = time.perf_counter() - self.ready
        return {**self.seconds, "update": update, "tokens": self.tokens}


def policy(trainer: Any) -> Any:
    """The model as the rollout samples it (`RolloutBatches._sampled`): the train state's
    arrays shared, eval mode, the run's precision."""
    from flax import nnx
    from zoo.engine.steps import precision

    model, _ = nnx.merge(trainer.graphdef, trainer.state)
    model.eval()
    return precision.computing(model, trainer.cfg.trainer.precision)


def decode_round(trainer: Any, prompts: Sequence[np.ndarray], new: int) -> tuple[float, float]:
    """`benchmarks.decode`'s timing of zoo's `Session` on the current policy and `prompts`:
    (seconds to the first new token, seconds of the rest), after a warm call."""
    from zoo.engine.sharding import mesh as sharding

    def activate():
        return sharding.activate(trainer.mesh, trainer.rules)

    run = decode.session_timer(policy(trainer), activate, len(prompts))
    run(prompts, new)
    return run(prompts, new)


def memory() -> dict[str, int | None]:
    """The process's peak resident bytes; the device's peak bytes in use where it keeps them."""
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "rss_peak_bytes": peak_resident_bytes(),
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
    }


def measure(checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    from zoo.engine.loop.trainer import Trainer

    import zoo

    with tempfile.TemporaryDirectory() as scratch:
        cfg = zoo.compose(overrides(checkpoint, prompt_file(Path(scratch)), args, scratch + "/run"))
        trainer = Trainer(cfg, jax.devices()[:1])
        clock = StepClock(trainer)
        steps = trainer.steps()
        try:
            clock.step(steps, trainer)  # compiles the sampler, the advantages and the train step
            rounds, decoded, peak = [], [], None
            for _ in range(args.repeats):
                rounds.append(clock.step(steps, trainer))
                peak = peak or memory()
                decoded.append(decode_round(trainer, clock.prompts, args.completion_tokens))
        finally:
            steps.close()
    return summary(trainer, clock, args, rounds, decoded, peak)


def summary(trainer, clock, args, rounds, decoded, peak) -> dict[str, Any]:
    median = {key: statistics.median(r[key] for r in rounds) for key in (*PHASES, "tokens")}
    step = sum(median[phase] for phase in PHASES)
    rollout_rate = statistics.median(r["tokens"] / r["rollout"] for r in rounds)
    batch, new = len(clock.prompts), args.completion_tokens
    prompt = max(len(p) for p in clock.prompts)
    rates = decode.rates(decoded, batch, prompt, new)
    rates["call_tokens_per_s"] = batch * new / statistics.median(f + r for f, r in decoded)
    return {
        "model": "tiny qwen3-chat fixture" if args.tiny else "Qwen3-0.6B architecture",
        "params": trainer.param_count,
        "device": jax.devices()[0].device_kind,
        "cores": len(os.sched_getaffinity(0)),
        "prompts": args.prompts,
        "generations": args.generations,
        "completion_tokens": new,
        "lora_rank": args.lora_rank,
        "repeats": args.repeats,
        "prompt_tokens": [len(p) for p in clock.prompts[:: args.generations]],
        "train_width": clock.width,
        "seconds": {**{phase: median[phase] for phase in PHASES}, "step": step},
        "share": {phase: median[phase] / step for phase in PHASES},
        "tokens_written": median["tokens"],
        "rollout_tokens_per_s": rollout_rate,
        "decode": rates,
        "rollout_x_decode": rollout_rate / rates["decode_tokens_per_s"],
        "memory": {"after_first_step": peak, "with_comparison": memory()},
        "rounds": rounds,
    }


def table(r: dict[str, Any]) -> str:
    mib = 2**20
    batch = f"{r['prompts']} prompts x {r['generations']}, {r['completion_tokens']} tokens"
    lora = f"LoRA rank {r['lora_rank']}" if r["lora_rank"] else "every param trained"
    where = f"{r['device']}, {r['cores']} cores"
    lines = [
        f"One GRPO step, {r['model']} ({r['params']:,} params), {batch}, {lora}, {where}",
        "",
        "| | figure |",
        "|---|---|",
    ]
    for phase in PHASES:
        lines.append(f"| {phase} | {r['seconds'][phase]:.3f} s ({r['share'][phase]:.0%}) |")
    d = r["decode"]
    rows = {
        "step": f"{r['seconds']['step']:.3f} s",
        "rollout tokens/s": f"{r['rollout_tokens_per_s']:.1f} ({r['tokens_written']:.0f} tokens)",
        "Session decode tokens/s (benchmarks.decode)": f"{d['decode_tokens_per_s']:.1f}",
        "Session whole call tokens/s": f"{d['call_tokens_per_s']:.1f}",
        "rollout / decode": f"{r['rollout_x_decode']:.2f}x",
    }
    for when, peak in r["memory"].items():
        figure = f"{peak['rss_peak_bytes'] / mib:.0f} MiB"
        if peak["device_peak_bytes"] is not None:
            figure += f", device {peak['device_peak_bytes'] / mib:.0f} MiB"
        rows[f"peak memory, {when.replace('_', ' ')}"] = figure
    lines += [f"| {name} | {figure} |" for name, figure in rows.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step")
    parser.add_argument("--generations", type=int, default=4, help="completions a prompt")
    parser.add_argument("--completion-tokens", type=int, default=32, help="most tokens of each")
    parser.add_argument("--lora-rank", type=int, default=16, help="0: every param trained")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (medians)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3 chat fixture")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where checkpoints are kept")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    checkpoint = CHAT_FIXTURE if args.tiny else chat_checkpoint(args.cache)
    results = measure(checkpoint, args)
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
