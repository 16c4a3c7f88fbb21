"""phloem's structured-generation DSL.

Programs append text, generations, choices and chat roles to a state; a backend serves them. Importing
this package needs neither torch nor the runtime.
"""

from __future__ import annotations

from phloem.lang.api import (
    BatchStates,
    Program,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_json,
    gen_string,
    get_default_backend,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from phloem.lang.backends import (
    Backend,
    BackendCapabilityError,
    BackendError,
    EngineBackend,
    OpenAIBackend,
    RuntimeEndpoint,
)
from phloem.lang.chat_template import ChatTemplate, register_chat_template
from phloem.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from phloem.lang.interpreter import ForkGroup, ProgramError, ProgramState
from phloem.lang.tracer import RequestTree

__all__ = [
    "Backend",
    "BatchStates",
    "BackendCapabilityError",
    "BackendError",
    "ChatTemplate",
    "ChoicesMethod",
    "EngineBackend",
    "ForkGroup",
    "OpenAIBackend",
    "Program",
    "ProgramError",
    "ProgramState",
    "RequestTree",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_json",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "register_chat_template",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
