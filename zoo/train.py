"""The command line: `python -m zoo.train model=xor [data=...] [key=value ...]`.

Hydra parses the overrides, prints `--help` and `--cfg job`, and owns logging; zoo checks the
overrides first so that a bad model name, key or type gets a one-paragraph message and exit
status 2 instead of a stack trace. Models registered by user code are accepted too: name the
modules that register them in `ZOO_PLUGINS` (comma-separated), or call `main()` from a script
that registers them first.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

import zoo
from train import resume
from train.console import CONSOLE
from train.signals import Interrupted
from zoo.hydra_store import store_registry

EXIT_BAD_INPUT = 2


def _fail(message: str) -> None:
    CONSOLE.print(f"error: {message}", markup=False)
    sys.exit(EXIT_BAD_INPUT)


def _train(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # one workdir per job of a sweep: <workdir>/<job>
        cfg.workdir = hydra_cfg.runtime.output_dir
    try:
        zoo.run(cfg)
    except zoo.ZooError as e:
        logging.getLogger("zoo").error("error: %s", e)
        sys.exit(EXIT_BAD_INPUT)
    except Interrupted as e:  # SIGTERM/SIGINT: checkpoint saved, logs flushed
        logging.getLogger("zoo").warning("%s", e)
        sys.exit(e.exit_code)


def load_plugins(env: str = "ZOO_PLUGINS") -> None:
    """Import the modules named in `$ZOO_PLUGINS` so the models they register exist."""
    for module in filter(None, (m.strip() for m in os.environ.get(env, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            _fail(f"Cannot import plugin module '{module}' named in ${env}: {e}.")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on `argv` (default: `sys.argv[1:]`)."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins()
    args, _ = get_args_parser().parse_known_args(argv)
    if not (args.help or args.hydra_help or args.multirun or args.info):
        try:
            cfg = zoo.compose(args.overrides)
            # Refuse a resume that cannot apply before Hydra writes .hydra/ into the workdir.
            resume.precheck(cfg)
        except zoo.ZooError as e:
            _fail(str(e))
    sys.argv = [sys.argv[0], *argv]
    store_registry()  # plugins may have registered models since
    hydra.main(version_base=None, config_path=None, config_name="config")(_train)()


if __name__ == "__main__":
    main()
