"""A request's route key: the chained block hashes of its prompt, computed as the replica's
prefix cache will compute them (kv_cache.hashing.chain_hashes over the same token ids, with
the request's cache_salt), so a router keyed by them agrees with what each replica caches.

The ingress holds the model's tokenizer (its vocabulary and chat template), not the model.
It reads each body with the server's own request models and renders chats with the same
template call, tools included, as the replica's routes do. A body it cannot read gets no key
(routed by load alone); the replica then answers it with its own error. Imports neither ray
nor torch."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from kvserve.entrypoints.server.chat_tools import template_tools
from kvserve.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.server.protocol_messages import MessagesRequest
from kvserve.entrypoints.server.protocol_responses import ResponsesRequest
from kvserve.kv_cache.hashing import chain_hashes
from kvserve.tokenizer.tokenizer import Tokenizer

# the routes whose bodies carry a prompt; every other request is routed by load
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


def chat_tokens(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt as the replica renders it (serving.encode_chat, through the same
    Tokenizer.encode_chat): the template over the messages, with the tools unless
    tool_choice is "none" (chat_tools.plan_chat's rule)."""
    choice = body.tool_choice if body.tool_choice is not None else \
        ("auto" if body.tools else "none")
    tools = template_tools(body.tools or []) if choice != "none" else None
    return tokenizer.encode_chat([m.for_template() for m in body.messages],
                                 body.add_generation_prompt, body.continue_final_message,
                                 tools=tools, **(body.chat_template_kwargs or {}))


def _chat(make: Callable[[dict], ChatCompletionRequest]) -> Callable:
    def tokens(tokenizer: Tokenizer, body: dict) -> tuple[list[int], str | None]:
        chat = make(body)
        return chat_tokens(tokenizer, chat), chat.cache_salt
    return tokens


def _completion(tokenizer: Tokenizer, body: dict) -> tuple[list[int], str | None]:
    """The first prompt's tokens (a list of prompts is one request per prompt on the same
    replica: the first one's prefix stands for them)."""
    req = CompletionRequest.model_validate(body)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return ids, req.cache_salt


def _responses(body: dict) -> ChatCompletionRequest:
    req = ResponsesRequest.model_validate(body)
    if req.previous_response_id is not None:
        raise LookupError("continues a stored response: pinned to its replica, not keyed")
    return req.chat_request([])


_TOKENS = {
    "/v1/completions": _completion,
    "/v1/chat/completions": _chat(ChatCompletionRequest.model_validate),
    "/v1/messages": _chat(lambda b: MessagesRequest.model_validate(b).chat_request()),
    "/v1/responses": _chat(_responses),
}


def prompt_tokens(tokenizer: Tokenizer, path: str, body: dict
                  ) -> tuple[list[int], str | None] | None:
    """(token ids, cache_salt) of the prompt a POST to `path` with `body` sends the engine,
    or None where there is none to key by (another route, a body the server would refuse, a
    Responses request continuing a stored one)."""
    tokens = _TOKENS.get(path)
    if tokens is None or not isinstance(body, dict):
        return None
    try:
        return tokens(tokenizer, body)
    except (ValidationError, LookupError, ValueError, TypeError, KeyError):
        return None
    except Exception:  # a chat template's own error: the replica reports it
        return None


def route_key(tokenizer: Tokenizer, block_size: int, path: str, body: dict
              ) -> tuple[int, ...]:
    """The chained hashes of the prompt's full blocks (empty: no key, route by load)."""
    got = prompt_tokens(tokenizer, path, body)
    if got is None:
        return ()
    ids, salt = got
    return tuple(chain_hashes(ids, block_size, salt))
