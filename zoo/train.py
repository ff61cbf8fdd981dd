"""The command line: `python -m zoo.train model=xor [data=...] [key=value ...]`, and sweeps
with `-m` (`python -m zoo.train -m model=xor seed=0,1,2`: one job per combination, in
`<workdir>/0`, `/1`, ...).

Every job is composed and checked before any job writes anything: an unknown name, key or type,
a value out of range or a resume that cannot apply gets a one-paragraph message, and that job
does not run. The good jobs then run one after another; the command exits with status 2 if any
job had bad input. A job writes into its workdir only once its trainer is built (mesh, data,
model): `.hydra/` (its config and overrides) and `train.log` come after that.

Hydra composes the configs and prints `--help`, `--hydra-help`, `--info` and `--cfg job`. Models
registered by user code are accepted too: name the modules that register them in `ZOO_PLUGINS`
(comma-separated), or call `main()` from a script that registers them first.
"""

from __future__ import annotations

import dataclasses
import logging
import logging.config
import os
import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from zoo.cli import load_plugins
from zoo.engine import checkpoints, registry
from zoo.engine.errors import ZooError
from zoo.engine.loop import Interrupted, RunLog, Trainer, check_buildable, check_usable
from zoo.engine.report import CONSOLE
from zoo.hydra_store import store_registry
from zoo.lm_evaluation import lm_eval_callbacks
from zoo.overrides import check_once, compose, sweep_jobs

EXIT_BAD_INPUT = 2

# The console: zoo's own lines plus real warnings from anywhere; the INFO chatter of absl, Orbax
# and JAX reaches each run's train.log only.
CONSOLE_LOGGING = {
    "version": 1,
    "formatters": {"console": {"format": "%(message)s"}},
    "handlers": {"console": {"class": "zoo.engine.report.ConsoleHandler", "formatter": "console"}},
    "root": {"level": "INFO", "handlers": ["console"]},
    "disable_existing_loggers": False,
}

log = logging.getLogger("zoo")


@dataclasses.dataclass
class Job:
    number: int | None  # its place in a sweep; None for a single run
    overrides: list[str]
    config: DictConfig | None = None
    error: str | None = None

    def name(self) -> str:
        return "" if self.number is None else f"job {self.number} ({' '.join(self.overrides)}): "


def plan(overrides: Sequence[str], multirun: bool) -> list[Job]:
    """Every job, composed and checked; a bad one carries its message instead of a config."""
    check_once(overrides)
    if not multirun:
        return [_checked(Job(None, list(overrides)))]
    return [_checked(Job(i, job)) for i, job in enumerate(sweep_jobs(overrides))]


def _checked(job: Job) -> Job:
    try:
        cfg = compose(job.overrides)
        if job.number is not None:  # one workdir per job of a sweep: <workdir>/<job>
            cfg.workdir = os.path.join(cfg.workdir, str(job.number))
        model, data = registry.get_model(cfg.model.name), registry.get_data(cfg.data.name)
        data_params = OmegaConf.to_container(cfg.data, enum_to_str=True)
        hparams = model.resolve(OmegaConf.to_container(cfg.model), data, data_params)
        check_buildable(model, hparams, cfg.finetune)
        check_usable(cfg.workdir, cfg.distributed.process_id or 0)
        checkpoints.precheck(cfg)
        job.config = cfg
    except ZooError as e:
        job.error = str(e)
    return job


def run(job: Job) -> int:
    """Train one job; its exit status."""
    with RunLog() as run_log:  # from the start: the trainer's set-up logs too
        try:
            trainer = Trainer(job.config, callbacks=lm_eval_callbacks(job.config))
            trainer.fit(overrides=job.overrides, run_log=run_log)
        except ZooError as e:  # in train.log too if the run had started writing
            log.error("error: %s%s", job.name(), e)
            return EXIT_BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on `argv` (default: `sys.argv[1:]`)."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_plugins()
    except ZooError as e:
        CONSOLE.print(f"error: {e}", markup=False)
        sys.exit(EXIT_BAD_INPUT)
    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.cfg:  # Hydra prints; nothing runs
        sys.argv = [sys.argv[0], *argv]
        store_registry()
        hydra.main(version_base=None, config_path=None, config_name="config")(lambda cfg: None)()
        return
    logging.config.dictConfig(CONSOLE_LOGGING)
    try:
        jobs = plan(args.overrides, args.multirun)
    except ZooError as e:
        jobs = [Job(None, list(args.overrides), error=str(e))]
    for job in jobs:
        if job.error is not None:
            CONSOLE.print(f"error: {job.name()}{job.error}", markup=False)
    status = 0 if all(job.error is None for job in jobs) else EXIT_BAD_INPUT
    for job in (job for job in jobs if job.error is None):
        try:
            status = max(status, run(job))
        except Interrupted as e:  # SIGTERM/SIGINT: checkpoint saved, logs flushed
            log.warning("%s", e)
            sys.exit(e.exit_code)
    sys.exit(status)


if __name__ == "__main__":
    main()
