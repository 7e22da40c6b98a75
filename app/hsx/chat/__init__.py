"""Chat conversations rendered into a target model's token ids and loss mask with the model's own chat
template (render), read from OpenAI- and ShareGPT-style samples (formats), and their assistant turns
generated anew by a model server (regenerate).

transformers is imported only when a template is loaded (`pip install 'hsx-server[chat]'`)."""

from hsx.chat.formats import ConversationError, Message, conversation_of
from hsx.chat.regenerate import (
    GenerationUnavailable,
    Regenerated,
    RegenerationError,
    Sampling,
    TemplateRenderer,
    regenerate,
)
from hsx.chat.render import ChatTemplate, ChatTemplateError, LossPolicy, Rendered, render_many

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ConversationError",
    "GenerationUnavailable",
    "LossPolicy",
    "Message",
    "Regenerated",
    "RegenerationError",
    "Rendered",
    "Sampling",
    "TemplateRenderer",
    "conversation_of",
    "regenerate",
    "render_many",
]
