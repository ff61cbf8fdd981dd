"""A conversation rendered with a checkpoint's chat template and tokenised, with the mask of the
tokens that carry loss (`data.loss_on`):

- `assistant`: the assistant's turns (of a prompt and completion: the completion). Where the
  template marks them with `{% generation %}` blocks, the marked text, as transformers' assistant
  token mask reads it. Otherwise each reply is found by rendering. It starts where the
  conversation before it, rendered with the opening of the assistant's turn (the generation
  prompt), ends. Where the conversation up to and including it, rendered alone, begins the whole
  text, the reply ends with the last end-of-turn token in that part (`<|im_end|>`, `<|eot_id|>`,
  `<end_of_turn>`: the checkpoint's `eos_token` and its generation config's `eos_token_id`s),
  or with that part when it has none; what follows the end-of-turn token there (a line break) is
  the template's. Where it does not (Qwen 3 renders the last reply with a thinking block that
  earlier ones lack), the reply ends with the first end-of-turn token after its start. So the
  reply's first token and its end-of-turn token carry loss; the system's, the user's and the
  template's tokens do not.
- `completion`: the last assistant turn only (of a prompt and completion: the completion).
- `all`: every token.

A token carries loss when its characters overlap a trained span (as transformers'
`char_to_token` marks them). The text is tokenised whole, with no special tokens added (the
template writes them), so the ids are those transformers' `apply_chat_template` gives.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from zoo.data.chat_template import ChatTemplate, Span, end_of_turn_ids, has_generation_markers
from zoo.data.conversations import ASSISTANT, Conversation
from zoo.data.text import TOKENIZER_FILE

from zoo.plugin import ZooError


class LossOn(str, enum.Enum):
    assistant = "assistant"
    completion = "completion"
    all = "all"


class RowProblem(Exception):
    """What makes a conversation untrainable (a template's refusal, no reply to train on)."""


@dataclasses.dataclass(frozen=True)
class Encoder:
    """Renders, tokenises and masks conversations for one checkpoint's template and tokenizer."""

    template: ChatTemplate
    tokenizer: Any
    end_of_turn: tuple[str, ...]
    loss_on: LossOn
    where: str
    """The template's directory, for messages."""
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The template's further variables (`data.template_kwargs`, e.g. `enable_thinking`)."""

    @classmethod
    def load(
        cls,
        directory: Path,
        tokenizer: Any,
        loss_on: LossOn,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Encoder:
        return cls(
            ChatTemplate.load(directory),
            tokenizer,
            end_of_turn_texts(directory, tokenizer),
            LossOn(loss_on),
            str(directory),
            dict(template_kwargs or {}),
        )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids of the tokens that end a reply, at which a model's writing stops."""
        ids = (self.tokenizer.token_to_id(text) for text in self.end_of_turn)
        return tuple(i for i in ids if i is not None)

    def encode(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, int32; 1 for each token that carries loss, uint8)."""
        messages = list(conversation.messages)
        try:
            text, spans = self._text_and_spans(conversation, messages)
        except ZooError as e:  # the template's refusal of this conversation
            raise RowProblem(str(e)) from None
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        trained = np.zeros(len(encoding.ids), np.uint8)
        for index, (start, end) in enumerate(encoding.offsets):
            at = (start, max(end, start + 1))  # a token of no characters sits at its start
            trained[index] = any(at[0] < stop and at[1] > begin for begin, stop in spans)
        return np.asarray(encoding.ids, np.int32), trained

    def _text_and_spans(self, conversation: Conversation, messages: list) -> tuple[str, list]:
        if self.loss_on == LossOn.all:
            text = self.render(messages, add_generation_prompt=False)
            return text, [(0, len(text))]
        replies = self._replies(conversation)
        if has_generation_markers(self.template.template):
            text, marked = self.template.render_with_spans(messages, **self.template_kwargs)
            if conversation.prompt is not None or self.loss_on == LossOn.completion:
                begin = self._start(messages, replies[0], text)
                marked = [span for span in marked if span[0] >= begin]
            spans = marked
        else:
            text = self.render(messages, add_generation_prompt=False)
            spans = [self._reply_span(messages, i, text) for i in replies]
        if not any(end > start for start, end in spans):
            raise RowProblem("has no reply text that the chat template marks for training")
        return text, spans

    def render(self, messages: list, add_generation_prompt: bool) -> str:
        """The template's text for `messages`, with `data.template_kwargs`."""
        return self.template.render(messages, add_generation_prompt, **self.template_kwargs)

    def _replies(self, conversation: Conversation) -> list[int]:
        """The indices of the messages that carry loss."""
        messages = conversation.messages
        if conversation.prompt is not None:
            return list(range(conversation.prompt, len(messages)))
        replies = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]
        if not replies:
            raise RowProblem("has no assistant message to train on")
        return replies[-1:] if self.loss_on == LossOn.completion else replies

    def _start(self, messages: list, index: int, text: str) -> int:
        """Where message `index` starts in `text`: after the conversation before it and the
        opening of the assistant's turn."""
        if index == 0:
            raise RowProblem("opens with the assistant's message, which nothing prompts")
        before = self.render(messages[:index], add_generation_prompt=True)
        if not text.startswith(before):
            raise ZooError(
                f"The chat template of {self.where} renders a conversation's opening "
                f"({len(before)} characters, up to message {index}) differently within the "
                "whole conversation than alone, so where each reply starts cannot be found: "
                "use a template that marks the replies with {% generation %} blocks, or "
                "data.loss_on=all."
            )
        return len(before)

    def _reply_span(self, messages: list, index: int, text: str) -> Span:
        start = self._start(messages, index, text)
        through = self.render(messages[: index + 1], add_generation_prompt=False)
        if text.startswith(through) and len(through) > start:
            end = len(through)
            found = [
                at + len(e) for e in self.end_of_turn if (at := text.rfind(e, start, end)) >= 0
            ]
            return start, max(found, default=end)
        ends = [at + len(e) for e in self.end_of_turn if (at := text.find(e, start)) >= 0]
        if not ends:
            raise ZooError(
                f"The chat template of {self.where} renders reply {index} differently within "
                "the whole conversation than at its end, and no end-of-turn token "
                f"({', '.join(self.end_of_turn) or 'none known'}) follows it: where the reply "
                "ends cannot be found. Use a template that marks the replies with "
                "{% generation %} blocks, or data.loss_on=all."
            )
        return start, min(ends)


def end_of_turn_texts(directory: Path, tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokens that end an assistant's turn: the template directory's
    `eos_token`, and its generation config's `eos_token_id`s where it holds a tokenizer."""
    ids = end_of_turn_ids(directory) if (directory / TOKENIZER_FILE).is_file() else ()
    texts = {tokenizer.id_to_token(i) for i in ids}
    texts.add(ChatTemplate.load(directory).tokens.get("eos_token"))
    return tuple(sorted(t for t in texts if t))


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`data.template_kwargs`: a mapping of the template's variable names to values."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ZooError(
            f"data.template_kwargs={kwargs!r} is not a mapping of names to values: give the "
            "chat template's variables by name, e.g. data.template_kwargs={enable_thinking:false}."
        )
    return dict(kwargs)
