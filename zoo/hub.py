"""Hugging Face Hub names where a pretrained directory goes: `hf://ORG/NAME[@REVISION]`.

`zoo.load`, `zoo.finetune`, `finetune.init_from=` and `python -m zoo.generate` take a hub name
and read the checkpoint from the directory `huggingface_hub` keeps it in: the hub's own cache
(`HF_HUB_CACHE`, by default `~/.cache/huggingface/hub`), downloaded there the first time. Only
the files a checkpoint is read from are fetched (`FILES`). `HF_HUB_OFFLINE=1` reads the cache
alone; a gated or private model takes the token `huggingface_hub` finds (`HF_TOKEN`, or
`hf auth login`). `@REVISION` names a branch, tag or commit (default: `main`).

A run records the directory the name resolved to as its `finetune.init_from` (its
`.hydra/overrides.yaml` keeps the name as typed): the engine reads a directory, and the cache's
path names the commit (`.../models--ORG--NAME/snapshots/<commit>`), so the record says exactly
which weights the run started from. Running the same command again resolves the name again, to
the same directory while the hub's `main` stays where it was; offline, from the cache.
"""

from __future__ import annotations

import os
import re
from typing import Any

from zoo.engine import weights
from zoo.engine.errors import ZooError

PREFIX = "hf://"

FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "spiece.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
]
"""What is downloaded of a model repository: the config, the weights (single or sharded), the
tokenizer (SigLIP's `spiece.model` too), the generation settings and chat template, a vision
model's preprocessing."""

_REPO = re.compile(r"[\w.-]+(/[\w.-]+)?")


def is_hub_name(value: object) -> bool:
    """Whether `value` is an `hf://` name (not a path)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def local(value: str | os.PathLike) -> str | os.PathLike:
    """The directory an `hf://` name resolves to (downloaded if need be); anything else as it is."""
    return resolve(value) if is_hub_name(value) else value


def resolve(name: str) -> str:
    """The local directory holding the checkpoint `name` (`hf://ORG/NAME[@REVISION]`), from the
    hub's cache, downloaded into it first when it is not there and the hub may be reached; else
    a `ZooError` naming the name and what to do."""
    repo, _, revision = name[len(PREFIX) :].partition("@")
    if not _REPO.fullmatch(repo) or "@" in revision:
        raise ZooError(
            f"{name} is not a Hugging Face Hub name: write hf://ORG/NAME, with @REVISION after it "
            "for a branch, tag or commit other than main (e.g. hf://Qwen/Qwen3-0.6B)."
        )
    directory = _download(name, repo, revision or None)
    if not weights.is_pretrained(directory):
        found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise ZooError(
            f"{name} holds no checkpoint zoo reads: its repository has no config.json with "
            f"safetensors weights beside it (downloaded: {', '.join(found) or 'nothing'}). zoo "
            "loads checkpoints saved as safetensors; see zoo.list_models(families=True)."
        )
    return directory


def _download(name: str, repo: str, revision: str | None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub

    try:
        return snapshot_download(repo, revision=revision, allow_patterns=FILES)
    except hub.GatedRepoError:
        raise ZooError(
            f"{name} is a gated model: accept its conditions at https://huggingface.co/{repo} "
            "with your account, then give zoo your token (`hf auth login`, or set HF_TOKEN)."
        ) from None
    except hub.RepositoryNotFoundError:
        raise ZooError(
            f"{name}: the Hugging Face Hub has no model repository '{repo}' that this machine "
            "may read. Check the name (ORG/NAME, as its page on huggingface.co shows it); for a "
            "private model, give zoo your token (`hf auth login`, or set HF_TOKEN)."
        ) from None
    except hub.RevisionNotFoundError:
        raise ZooError(
            f"{name}: model '{repo}' has no revision '{revision}': name a branch, tag or commit "
            f"of the repository, or leave @{revision} out for main."
        ) from None
    except hub.LocalEntryNotFoundError as e:
        download = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise ZooError(_not_cached(name, download, constants, e)) from None
    except hub.IncompleteSnapshotError:
        raise ZooError(
            f"{name}: the copy in the Hugging Face cache {constants.HF_HUB_CACHE} is incomplete "
            "(a download was interrupted) and the hub cannot be reached to finish it: run the "
            "same command again online."
        ) from None
    except (hub.HfHubHTTPError, OSError) as e:
        raise ZooError(f"Cannot download {name} from the Hugging Face Hub: {e}.") from None


def _not_cached(name: str, download: str, constants: Any, error: Exception) -> str:
    """Why a name without a cached copy could not be downloaded, and what to do (`download`:
    the command that would fetch it)."""
    where = f"not in the Hugging Face cache {constants.HF_HUB_CACHE}"
    if constants.is_offline_mode():
        return (
            f"{name} is {where}, and HF_HUB_OFFLINE=1 keeps zoo from downloading it: run once "
            f"without HF_HUB_OFFLINE (or `{download}`) to fetch it, or set HF_HUB_CACHE to the "
            "cache that holds it."
        )
    cause = error.__cause__ or error
    return (
        f"{name} is {where}, and the Hugging Face Hub cannot be reached "
        f"({type(cause).__name__}): connect to the internet and run again, or fetch it where you "
        f"can (`{download}`) and set HF_HUB_CACHE to that cache."
    )
