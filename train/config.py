"""The typed config schema of a run: one dataclass per section, checked by OmegaConf.

The command line and the Python API compose configs against this schema (a wrong key or type
fails there), and `zoo.engine.loop.config_checks` checks what types cannot say (ranges, cadences, meshes). The
model's and the data set's sections come from their registered signatures.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from zoo.engine.errors import ZooError
from zoo.engine.posttraining import GRPOOptions, PreferenceOptions
from zoo.engine.sharding.mesh import DEFAULT_RULES


class OptimizerName(str, enum.Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class BestMode(str, enum.Enum):
    min = "min"
    max = "max"


class NanPolicy(str, enum.Enum):
    stop = "stop"
    skip = "skip"


class Method(str, enum.Enum):
    sft = "sft"
    dpo = "dpo"
    grpo = "grpo"


class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class ScheduleName(str, enum.Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


@dataclasses.dataclass
class EarlyStopConfig:
    # Stop once this eval metric (e.g. `loss`, `accuracy`) has not improved by more than
    # `min_delta` for `patience` evals in a row; null: train to trainer.steps.
    metric: str | None = None
    mode: BestMode = BestMode.min  # `min` for a loss, `max` for an accuracy
    patience: int = 3  # evals in a row without an improvement before the run stops
    # An improvement is a change in the right direction larger than this, in the metric's units.
    min_delta: float = 0.0


@dataclasses.dataclass
class TrainerConfig:
    # Optimizer updates to train in all, counted across resumes: a resumed run continues to this
    # step (raise it to train longer); the learning-rate schedule spans it.
    steps: int = 1000
    # Train this many passes over the training split in place of setting trainer.steps, which
    # becomes ceil(epochs x training rows / batch_size) at composition, said in one line: a last
    # partial batch is a whole step; with data.packing the rows are the packed rows. null: none.
    epochs: int | None = None
    # Examples per step in all devices and processes together, split over the mesh axes of the
    # `batch` rule (`data` and `fsdp`): a multiple of their product.
    batch_size: int = 128
    # Eval (over the whole eval split) every N steps and always after the last step; 0: only then.
    eval_every: int = 0
    # Steps per log window: TensorBoard's `train/` curves and the console show means over each.
    log_every: int = 50
    # Checkpoint every N steps and always after the last step; 0: only then.
    checkpoint_every: int = 0
    # Keep the latest N checkpoints (and the best one, with `best_metric`).
    keep: int = 3
    # Also keep the checkpoint with the best value of this eval metric (e.g. `loss`, `accuracy`)
    # among those saved at an eval step; null: keep only the latest.
    best_metric: str | None = None
    best_mode: BestMode = BestMode.min  # `min` for a loss, `max` for an accuracy
    # `auto`: continue from the latest readable checkpoint in the workdir, if any; `never`: start
    # fresh (refused if the workdir holds checkpoints); a step number: continue from that one.
    resume: str = "auto"
    # A NaN or Inf training loss: `stop` the run (keeping the last good checkpoint), or `skip`
    # that step's update and go on.
    nan_policy: NanPolicy = NanPolicy.stop
    # Run this many train steps per call from the host, in one compiled loop (same bits, metrics
    # still per step): pays off for tiny models, whose steps are shorter than the host's work
    # per step. steps, log_every, eval_every and checkpoint_every must be multiples of it.
    steps_per_dispatch: int = 1
    # `[first, last]`: write a JAX profiler trace of these steps into the run's TensorBoard
    # directory; empty: no trace.
    profile_steps: list[int] = dataclasses.field(default_factory=list)
    # Split each batch into N equal microbatches, run one after another inside the step (the
    # activations of one microbatch alive at a time), then make one update: the full batch's,
    # up to float rounding. batch_size must be a multiple of N x (data*fsdp).
    grad_accum_steps: int = 1
    # `bf16`: forward and backward passes in bfloat16 (params cast at the start of each step;
    # softmax, norm statistics, losses and metrics in float32); params, optimizer state and
    # checkpoints stay float32. `fp32`: everything in float32.
    precision: Precision = Precision.fp32
    early_stop: EarlyStopConfig = dataclasses.field(default_factory=EarlyStopConfig)
    # Debug a model: run every step un-jitted (`jax.disable_jit`) with NaN checks on
    # (`jax_debug_nans`), so print(), breakpoint() and jax.debug.print work inside it. Slow.
    debug: bool = False


@dataclasses.dataclass
class LoggingConfig:
    # Histograms of every param and its gradient every N steps; 0: never (the default: they
    # cost a second gradient computation at each of those steps).
    histogram_every: int = 0
    # Global gradient norm, parameter norm and update/parameter ratio, sampled every N steps
    # (each sample costs about one extra gradient computation); 0: never.
    norms_every: int = 500
    # The model's own report at each eval, beside the eval metrics: a language model's sampled
    # text or replies and a mixture's expert load, a classifier's or VAE's images. false: the
    # metrics alone, for evals that cost only the eval pass (a language model's sample
    # generates token by token).
    eval_reports: bool = True


@dataclasses.dataclass
class LMEvalConfig:
    # lm-evaluation-harness tasks (the `eval` extra) run on the run's checkpoints as they are
    # saved, their metrics written to its TensorBoard as `lm_eval/<task>/<metric>` at the
    # checkpoint's step: the harness's task, group or tag names, or those of the YAML files in
    # `include`; empty: none.
    tasks: list[str] = dataclasses.field(default_factory=list)
    # Run them on each checkpoint whose step is a multiple of this: a positive multiple of
    # trainer.checkpoint_every (which must then be positive); null: on every checkpoint saved
    # every trainer.checkpoint_every steps.
    every: int | None = None
    # Folders of task YAML files, e.g. [my_tasks] (tasks over local files need no download).
    include: list[str] = dataclasses.field(default_factory=list)
    # The first N documents of each task (a fraction below 1: that share of them); null: all.
    limit: float | None = None
    # Solved examples before each question; null: the task's own (mostly 0).
    num_fewshot: int | None = None
    batch_size: int = 8  # rows per forward pass, and prompts per generation batch


@dataclasses.dataclass
class OptimizerConfig:
    # optax's `sgd` (with `momentum`), `adam`, or `adamw` (with `weight_decay`).
    name: OptimizerName = OptimizerName.adam
    learning_rate: float = 1e-3  # the peak learning rate, reached after the warm-up
    # The peak learning rate is reached after `warmup_steps` of linear warm-up, then `schedule`
    # decays it to `learning_rate * final_lr_fraction` at the last step.
    schedule: ScheduleName = ScheduleName.constant
    warmup_steps: int = 0  # steps of linear warm-up from 0 to `learning_rate`; 0: none
    # Where `cosine` and `linear` end at the last step, as a fraction of `learning_rate` (0 to 1).
    final_lr_fraction: float = 0.0
    momentum: float = 0.0  # sgd only; 0 is plain SGD
    weight_decay: float = 1e-4  # adamw only
    # adamw: decay every param, instead of only the Linear, Conv and LoRA weights (the default
    # leaves biases, norm scales and embeddings alone).
    decay_all: bool = False
    # Clip the gradients to this global norm before the update; null: no clipping.
    grad_clip_norm: float | None = None
    # Keep an exponential moving average of the trained params with this decay (e.g. 0.999),
    # evaluated beside them (val_ema/*) and loadable with zoo.load(..., weights="ema"); costs
    # one more copy of the trained params in memory and checkpoints. null: none.
    ema_decay: float | None = None


@dataclasses.dataclass
class MeshConfig:
    # Devices along the mesh's `data` axis (data parallel: each holds a share of the batch).
    # The axes' product is the device count; one of them may be -1: all the devices the others
    # leave.
    data: int = -1
    # Devices along the `fsdp` axis: the batch and the params' `embed` dimension are split over
    # them (fully sharded data parallel); -1: all the devices the others leave.
    fsdp: int = 1
    # Devices along the `expert` axis (expert parallel): a mixture of experts' experts are split
    # over them, each device holding 1/expert of them, and the batch too (between the mixture
    # layers they are data parallel); it must divide the number of experts. -1: all the devices
    # the others leave.
    expert: int = 1
    # Devices along the `tensor` axis: attention heads, MLP units, the vocabulary and conv output
    # channels are split over them (tensor parallel); -1: all the devices the others leave.
    tensor: int = 1
    # Logical axis name (of a param or activation dimension) -> the mesh axis that splits it, a
    # list of them, or null (replicated); `mesh.rules.embed=null` changes one,
    # `+mesh.rules.NAME=AXIS` adds one. A name a model uses without a rule stops the run.
    rules: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))
    # Simulated CPU devices for this process (0: what the platform has); must be set before
    # JAX starts, so it works from the command line, not after JAX is already in use.
    cpu_devices: int = 0


@dataclasses.dataclass
class DistributedConfig:
    # Several processes (one per host, typically): `host:port` of process 0, which they all
    # join; null: read from the environment where it names a job (JAX_COORDINATOR_ADDRESS,
    # SLURM, Open MPI), else this process runs alone.
    coordinator: str | None = None
    # Processes in the job; null: read from the environment.
    num_processes: int | None = None
    # This process's rank, 0 to num_processes - 1; null: read from the environment.
    process_id: int | None = None
    # Seconds: a process that has not been heard from for this long is dead, and the others stop
    # with an error instead of waiting for it forever.
    heartbeat_timeout: int = 100


@dataclasses.dataclass
class FinetuneConfig:
    # Start from the weights of another run: its workdir (null: fresh weights). Params and
    # BatchNorm statistics are restored; RNG streams and the optimizer start fresh.
    init_from: str | None = None
    # Which of its checkpoints: `latest`, `best` (by its trainer.best_metric, else eval loss) or
    # a step number.
    init_step: str = "latest"
    # Params that keep their fresh initialisation instead of being restored (path patterns,
    # e.g. [head] for a new classification head). Any other param whose shape differs from the
    # checkpoint's is an error.
    reinit: list[str] = dataclasses.field(default_factory=list)
    # Params that get no gradient and no optimizer state: a path pattern, or `backbone` for every
    # param outside `head`. A BatchNorm whose params are all frozen keeps its statistics too.
    freeze: str | None = None
    # The path of the model's classification head (every model of the zoo calls it `head`).
    head: str = "head"
    # Add LoRA adapters of this rank to the dense layers (Linear, and attention's projections)
    # that `lora_layers` matches and train only them (and the params in `reinit`); 0: none.
    lora_rank: int = 0
    # The dense layers that get adapters: a path pattern (a regex naming a module by its dotted
    # path or a leading part of it, e.g. `hidden`, `attention`); `.*`: every dense layer.
    lora_layers: str = ".*"
    # QLoRA: hold the base kernel of every adapted layer quantized (`int8`; `int4`; `nf4`, the
    # 4-bit NormalFloat format), one scale per output channel and per 64 inputs, or `mxfp4`
    # (FP4 codes, a power of two per 32 inputs: gpt-oss's MXFP4 experts held as the hub stores
    # them), dequantized in the forward pass; frozen, with the adapters trained in float32.
    # A mixture's experts (in lora_layers) are held so too. Needs lora_rank > 0. null: the
    # base kernels stay as they are.
    quantize: str | None = None
    # What the fine-tune learns from: `sft`, the data's own targets (imitation, the model's
    # loss); `dpo`, preference pairs (data=preference), by the loss of `finetune.dpo`; `grpo`,
    # rewards of completions it samples of prompts (data=prompts), as `finetune.grpo` says.
    method: Method = Method.sft
    # The preference loss of finetune.method=dpo and its settings.
    dpo: PreferenceOptions = dataclasses.field(default_factory=PreferenceOptions)
    # The sampling, rewards and loss of finetune.method=grpo.
    grpo: GRPOOptions = dataclasses.field(default_factory=GRPOOptions)


@dataclasses.dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    lm_eval: LMEvalConfig = dataclasses.field(default_factory=LMEvalConfig)
    # The directory that everything the run writes goes into (TensorBoard events, checkpoints,
    # train.log, the composed config); a run started again in it resumes (trainer.resume).
    workdir: str = "runs/${model.name}/${now:%Y%m%d-%H%M%S}"
    # Every random key (initialisation, Dropout, shuffling, augmentation) is derived from it: the
    # same config and seed give the same bits.
    seed: int = 0


def checked_dict(schema: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Defaults of `schema` updated by `values`, type-checked the same way the CLI checks."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), dict(values))
    except OmegaConfBaseException as e:
        raise ZooError(f"Invalid value for {what}: {reason(e)}.") from None
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def resume_step(resume: Any) -> int | None:
    """The step that `trainer.resume` names, or None for `auto`/`never`/anything else."""
    text = str(resume).strip()
    return int(text) if text.isdigit() else None


def reason(error: OmegaConfBaseException) -> str:
    """The first line of an OmegaConf error, on one line."""
    return " ".join(str(getattr(error, "msg", None) or error).split("\n")[0].split())


def checked_params(what: str, schema: type, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A registered model's or data set's parameters: its defaults, then `overrides`, each
    named in its schema and type-checked."""
    valid = [f.name for f in dataclasses.fields(schema) if f.name != "name"]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ZooError(
            f"Unknown parameter(s) {', '.join(map(repr, unknown))} for {what}. "
            f"Valid parameters: {', '.join(valid)}."
        )
    return checked_dict(schema, overrides, what)
