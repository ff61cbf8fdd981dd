"""Chat templates: the text a chat checkpoint's model reads for a conversation.

The front's name for `zoo.data.chat_template`, where the renderer lives so that the chat data set
(`data=chat`) renders conversations with it as generation does: a checkpoint's template read
from its directory, rendered as transformers' `apply_chat_template` renders it in Jinja's
sandbox, with the character spans of its `{% generation %}` blocks and the end-of-turn token ids
(see that module for the details).
"""

from zoo.data.chat_template import (
    GENERATION_CONFIG,
    REASONING_FIELDS,
    SPECIAL_TOKENS_MAP,
    STANDARD_TOKENS,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    VALID_MESSAGE,
    ChatTemplate,
    Span,
    end_of_turn_ids,
    has_generation_markers,
    read_chat_template,
    render_chat,
    render_chat_with_spans,
    special_tokens,
    template_variables,
)

__all__ = [
    "GENERATION_CONFIG",
    "REASONING_FIELDS",
    "SPECIAL_TOKENS_MAP",
    "STANDARD_TOKENS",
    "TEMPLATE_FILE",
    "TOKENIZER_CONFIG",
    "VALID_MESSAGE",
    "ChatTemplate",
    "Span",
    "end_of_turn_ids",
    "has_generation_markers",
    "read_chat_template",
    "render_chat",
    "render_chat_with_spans",
    "special_tokens",
    "template_variables",
]
