"""The keys that the data sets rendered with a checkpoint's chat template (`data=chat`,
`preference`, `prompts`) share, defined once in `ChatOptions`: the tokenizer and template, the
roles a message may have, the buckets, the held-out rows, bad-row handling and the replies
written at evals.

A loader takes them as one parameter, `options: ChatOptions`: the registry makes its fields keys
of the data set, after the loader's own (`zoo.engine.registry.options_parameters`), and builds
the options from them, checked, before the loader runs; the config reference documents each key
by the comment of its field here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zoo.data.chat_tokens import Encoder, LossOn, check_template_kwargs
from zoo.data.conversations import ASSISTANT, CONVERSATIONS, DEFAULT_ROLES, RowKind
from zoo.data.image_examples import OnError
from zoo.data.text import load_tokenizer, tokenizer_file

from zoo.plugin import ZooError


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a chat data set's rows are rendered, tokenised, padded and held out; the buckets,
    share, roles and reply counts are checked, and refused by their key, when the options are
    made."""

    # The checkpoint's `tokenizer.json` or its directory (`finetune.init_from` sets it).
    tokenizer: str | None = None
    # The directory whose chat template renders the rows (conversations, pairs or prompts); null:
    # the tokenizer's.
    template: str | None = None
    # The roles a message may have; another is a bad row.
    roles: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ROLES))
    # Lengths a batch is padded to (the smallest that holds its longest sequence); a longer
    # conversation or pair is cut to the largest, a longer prompt is a bad row.
    buckets: list[int] = dataclasses.field(default_factory=lambda: [128, 256, 512, 1024])
    # Share of the rows (conversations, pairs or prompts) held out for evaluation when there is no
    # `val/` folder.
    eval_fraction: float = 0.1
    # A row that is no conversation, pair or prompt to train on: `skip` it with a warning, or
    # `raise`: stop, naming them all.
    on_error: OnError = OnError.skip
    # Variables the chat template reads besides the messages (e.g. {enable_thinking: false}).
    template_kwargs: Any = None
    # Held-out prompts whose replies each eval writes to TensorBoard's text tab (0: none).
    eval_replies: int = 3
    # The most new tokens a reply written at an eval takes.
    eval_reply_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.buckets or min(self.buckets) < 1:
            raise ZooError(
                f"data.buckets={list(self.buckets)} must be one or more positive lengths."
            )
        if not 0 < self.eval_fraction < 1:
            raise ZooError(
                f"data.eval_fraction={self.eval_fraction} must be between 0 and 1 (exclusive): "
                "the share of the rows held out when there is no val/ folder."
            )
        if ASSISTANT not in self.roles:
            raise ZooError(
                f"data.roles={list(self.roles)} must include 'assistant', the role whose replies "
                "are trained."
            )
        if self.eval_replies < 0:
            raise ZooError(
                f"data.eval_replies={self.eval_replies} must be 0 (no replies at evals) or the "
                "number of held-out prompts whose replies each eval writes."
            )
        if self.eval_reply_tokens < 1:
            raise ZooError(
                f"data.eval_reply_tokens={self.eval_reply_tokens} must be at least 1: the most "
                "new tokens a reply written at an eval takes."
            )

    def encoder(self, loss_on: LossOn, kind: RowKind = CONVERSATIONS) -> tuple[Path, Encoder]:
        """(the tokenizer's file, the encoder) of `data.tokenizer`, `data.template` and
        `data.template_kwargs`, each checked; `kind`: the rows the data set renders."""
        if self.tokenizer is None and self.template is None:
            raise ZooError(
                f"{kind.data_set} renders {kind.row}s with a checkpoint's chat template and "
                "tokenizer: start from one (finetune.init_from=DIR or hf://ORG/NAME sets "
                "data.tokenizer), or set data.tokenizer=DIR naming a directory with its "
                "tokenizer.json and chat template."
            )
        file = tokenizer_file(self.tokenizer if self.tokenizer is not None else self.template)
        directory = Path(self.template).expanduser() if self.template is not None else file.parent
        if not directory.is_dir():
            raise ZooError(
                f"data.template={self.template} is not a directory: name the checkpoint directory "
                "whose chat_template.jinja (or tokenizer_config.json's chat_template) renders the "
                "conversations, or leave it unset for the tokenizer's directory."
            )
        kwargs = check_template_kwargs(self.template_kwargs)
        return file, Encoder.load(directory, load_tokenizer(file), loss_on, kwargs)
