"""Where a run starts: a checkpoint of its own workdir, another run's weights, or its seed.

The order, first match wins:
  1. `trainer.resume=<step>`: that checkpoint of this workdir; if it cannot be read, an error
     (an explicit step never falls back).
  2. `trainer.resume=auto` (the default): the latest readable checkpoint of this workdir. Later
     ones that cannot be read are set aside as `<step>.unreadable`, with a warning naming each.
     If none can be read, an error: the run never silently starts over on top of them.
  3. No checkpoint (or `trainer.resume=never` on a workdir without any): a fresh start, its
     params and BatchNorm statistics filled from `finetune.init_from` when that is set (a zoo
     workdir, or a pretrained checkpoint directory: see `zoo.engine.weights.pretrained`).
  4. Otherwise a fresh start from the seed.

A restored checkpoint gives everything the run's future depends on: the state (resharded onto
this run's mesh), the open log window's sums, the data iterator's position, the last eval.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx
from jax.sharding import Mesh
from omegaconf import DictConfig
from zoo.engine.checkpoints import resume
from zoo.engine.checkpoints.failures import reason
from zoo.engine.checkpoints.manager import FORMATS, Checkpointer
from zoo.engine.checkpoints.reader import abstract_like, read_json, saved_steps
from zoo.engine.checkpoints.warm_start import read_first, warm_start
from zoo.engine.config import resume_step
from zoo.engine.errors import ZooError
from zoo.engine.sharding.mesh import AxisRules
from zoo.engine.steps.functions import Metrics
from zoo.engine.weights import pretrained as weights

if TYPE_CHECKING:
    import grain

log = logging.getLogger("zoo")
_timing_log = logging.getLogger("train.timing")  # train.log only, not the console


@dataclasses.dataclass
class Progress:
    """Where a run is: the last step done, the open log window, the last eval."""

    step: int
    window: Metrics
    window_start: int
    eval_step: int
    eval_metrics: dict[str, float]
    early_stop: dict[str, Any] = dataclasses.field(default_factory=dict)  # its saved counters
    # XLA compilations of the run so far, in every process it ran in: `count` and `seconds`
    compiles: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RunStart:
    """What `start_run` needs of the run: its config (and that config as saved in checkpoints),
    its state and graphdef, a fresh data iterator, zero window sums, its base key, and the
    model's constructor arguments with what the data set decides filled in."""

    cfg: DictConfig
    saved_config: Mapping[str, Any]
    graphdef: nnx.GraphDef
    state: Any
    iterator: grain.DatasetIterator
    zeros: Metrics
    base_key: jax.Array
    hparams: Mapping[str, Any]
    warm_start: WarmStart | None = None  # step 3, done as the model was built


def start_run(run: RunStart, checkpointer: Checkpointer) -> tuple[Any, Progress]:
    """The state the run starts from and where it stands, by the order above; the iterator is
    set to the restored position."""
    resumed = _resume(run, checkpointer)
    if resumed is not None:
        return resumed
    fresh = Progress(step=0, window=run.zeros, window_start=0, eval_step=0, eval_metrics={})
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(run.state)):
        raise ZooError(
            f"The checkpoints in {checkpointer.directory} that this run was set up to resume "
            "from are gone: nothing was changed; run the same command again to start afresh."
        )
    if run.cfg.finetune.init_from is None:
        return run.state, fresh
    if run.warm_start is not None and run.warm_start.said:
        log.info(*run.warm_start.said)  # filled as the model was built
        return run.state, fresh
    return _warm_start(run), fresh


def _resume(run: RunStart, checkpointer: Checkpointer) -> tuple[Any, Progress] | None:
    """Steps 1 and 2: the restored state and progress, or None when there is no checkpoint."""
    explicit = resume_step(run.cfg.trainer.resume) is not None
    unreadable: list[tuple[int, str]] = []
    for step in resume.candidates(checkpointer, str(run.cfg.trainer.resume)):
        restored, why = _restore(run, checkpointer, step)
        if why is not None:
            unreadable.append((step, why))
            if explicit:
                break
            continue
        meta = restored["meta"]
        _check_meta(run, step, checkpointer.step_path(step), meta)
        _set_aside(checkpointer, unreadable, step)
        return restored["state"], Progress(
            step=step,
            window=restored["window"],
            window_start=int(meta["window_start"]),
            eval_step=int(meta["eval"]["step"]),
            eval_metrics=dict(meta["eval"]["metrics"]),
            early_stop=dict(meta.get("early_stop", {})),
            compiles=dict(meta.get("compiles", {})),
        )
    if unreadable:
        raise _unreadable(checkpointer, unreadable, explicit)
    return None


def _restore(
    run: RunStart, checkpointer: Checkpointer, step: int
) -> tuple[dict[str, Any] | None, str | None]:
    """(everything saved at `step`, None), or (None, why it cannot be read)."""
    path = checkpointer.step_path(step)
    saved_config, why = _read(checkpointer.restore_config, step)
    if why is not None:
        return None, why
    changed = resume.check_config(step, path, saved_config, run.saved_config)
    started = time.perf_counter()
    restored, why = _read(
        checkpointer.restore,
        step,
        abstract_like(run.state),
        run.iterator,
        abstract_like(run.zeros),
    )
    if why is None:
        seconds = time.perf_counter() - started
        _timing_log.info("Restored step %d from %s in %.3f s", step, path, seconds)
        if changed:
            log.info("Resuming with changed settings: %s", "; ".join(changed))
    return restored, why


def _read(load: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """`(load(*args), None)`, or `(None, why)` when the checkpoint cannot be read at all."""
    try:
        return load(*args), None
    except Exception as e:  # noqa: BLE001  (any read failure: the caller tries an older step)
        return None, reason(e)


def _check_meta(run: RunStart, step: int, path: str, meta: Mapping[str, Any]) -> None:
    expected = jax.random.key_data(run.base_key).tolist()
    if meta.get("format") not in FORMATS or meta.get("base_key") != expected:
        raise ZooError(
            f"The checkpoint at step {step} ({path}) was written by an incompatible version "
            f"of zoo (format {meta.get('format')}, expected one of {list(FORMATS)}; or another "
            "base PRNG key for this seed). Use another workdir to start a new run."
        )


def _set_aside(checkpointer: Checkpointer, unreadable: list[tuple[int, str]], step: int) -> None:
    """Rename the later checkpoints that could not be read, saying so, before resuming."""
    for bad_step, why in unreadable:
        aside = checkpointer.set_aside(bad_step)
        log.warning(
            "Checkpoint at step %d (%s) cannot be read (%s); kept as %s. Falling back to step %d.",
            bad_step,
            checkpointer.step_path(bad_step),
            why,
            aside,
            step,
        )


def _unreadable(
    checkpointer: Checkpointer, unreadable: list[tuple[int, str]], explicit: bool
) -> ZooError:
    if explicit:
        step, why = unreadable[0]
        return ZooError(
            f"Cannot resume from trainer.resume={step}: the checkpoint at "
            f"{checkpointer.step_path(step)} cannot be read ({why}). Nothing was changed; "
            "trainer.resume=auto falls back to the latest readable earlier step."
        )
    details = "; ".join(f"step {s} at {checkpointer.step_path(s)}: {w}" for s, w in unreadable)
    return ZooError(
        f"Cannot resume: no checkpoint in {checkpointer.directory} can be read ({details}). "
        "Nothing was changed; move the damaged checkpoints away to start over, or use another "
        "workdir."
    )


def starting_state(cfg: DictConfig, graphdef: nnx.GraphDef, state: Any, hparams: Mapping) -> Any:
    """What a fresh start of the run begins with (steps 3 and 4, whatever the workdir holds):
    `state`, its params filled from `finetune.init_from` where that is set, in new arrays
    (`state` is left as it is). For what depends on the starting weights alone, such as a
    preference fine-tune's reference log-probabilities, resumed runs included."""
    if cfg.finetune.init_from is None:
        return state
    run = RunStart(cfg, {}, graphdef, state, None, {}, None, hparams)
    return _warm_start(run, say=log.debug)


def _warm_start(run: RunStart, say: Callable[..., None] = log.info) -> Any:
    """Step 3: a fresh fine-tune's state, its params and BatchNorm statistics from
    `finetune.init_from`."""
    model, optimizer = nnx.merge(run.graphdef, run.state)
    say(*_fill_from_init(run.cfg, run.hparams, model))
    return nnx.state((model, optimizer))


@dataclasses.dataclass
class WarmStart:
    """Step 3 done as the model is built: `finetune.init_from`'s weights filled into the
    abstract model (the `prefill` of `zoo.engine.loop.build.build_on_mesh`), so that the params
    they fill are never initialised only to be overwritten: not computed, not compiled, and
    never held twice at once (a 30B-param fine-tune's start would otherwise hold its random
    weights and its checkpoint's together). `said` is the line `start_run` logs for it."""

    cfg: DictConfig
    hparams: Mapping[str, Any]
    mesh: Mesh
    rules: AxisRules
    said: tuple[Any, ...] = ()

    def __call__(self, model: nnx.Module) -> None:
        self.said = _fill_from_init(self.cfg, self.hparams, model, self.mesh, self.rules)


def resumes(cfg: DictConfig, checkpoints: str) -> bool:
    """Whether the run restores its state from a checkpoint of its own in `checkpoints` (steps
    1 and 2), or stops saying why it cannot: its state is then built abstract, since every
    array of it is restored over whatever it was built with (nor is its state held twice)."""
    return str(cfg.trainer.resume) != "never" and bool(saved_steps(checkpoints))


def warm_start_on_build(
    cfg: DictConfig, hparams: Mapping[str, Any], mesh: Mesh, rules: AxisRules, checkpoints: str
) -> WarmStart | None:
    """The `WarmStart` of a fine-tune that starts fresh: `finetune.init_from` set and no
    checkpoint of its own in `checkpoints` (a run that has one resumes from it, step 1 or 2, and
    its weights are restored over whatever it was built with)."""
    if cfg.finetune.init_from is None or saved_steps(checkpoints):
        return None
    return WarmStart(cfg, hparams, mesh, rules)


def _fill_from_init(
    cfg: DictConfig,
    hparams: Mapping[str, Any],
    model: nnx.Module,
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
) -> tuple[Any, ...]:
    """Fill `model`'s params and BatchNorm statistics from `finetune.init_from` (an abstract
    model's: into the shardings `mesh` and `rules` give); the log line that says so."""
    finetune, name = cfg.finetune, cfg.model.name
    reinit = list(finetune.reinit)
    if weights.is_pretrained(finetune.init_from):
        pretrained = weights.open_pretrained(finetune.init_from, name)
        fresh = weights.fill(
            model, pretrained, hparams=hparams, skip=reinit, mesh=mesh, rules=rules
        )
        where = (pretrained.family.name, pretrained.directory)
        return ("Starting from the %s checkpoint in %s%s", *where, _afresh(fresh))

    def read(step: int, path: str) -> list[str]:
        trained = read_json(path, "config")["model"]["name"]
        if trained != name:
            raise ZooError(
                f"finetune.init_from={finetune.init_from} holds a '{trained}' model, but this "
                f"run builds '{name}': use model={trained}."
            )
        return warm_start(model, path, reinit, "finetune.reinit", mesh, rules)

    step, path, fresh = read_first(finetune.init_from, finetune.init_step, read)
    return ("Starting from %s (step %d)%s", path, step, _afresh(fresh))


def _afresh(fresh: list[str]) -> str:
    return f"; initialised afresh: {', '.join(fresh)}" if fresh else ""
