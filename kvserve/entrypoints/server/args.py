"""`kvserve serve`'s own settings, beside EngineArgs: the server's, and the connection
limits that guard it against slow and greedy clients (the request limits are in
server.limits). Each is declared once, as its flag (kvserve.settings); this module imports
neither torch nor FastAPI, since the command line is parsed before either loads."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from kvserve.entrypoints.server.limits import RequestLimits
from kvserve.entrypoints.server.reasoning import REASONING_PARSERS
from kvserve.entrypoints.server.tool_parsers import TOOL_PARSERS
from kvserve.settings import add_fields_as_flags, fields_from_flags, setting, size_arg


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = setting(10.0, "seconds a client has to send a whole request head "
                                          "(else 408)")
    read_timeout: float = setting(30.0, "seconds a request body may go without a byte "
                                        "(else 408)")
    write_timeout: float = setting(60.0, "seconds a client may stop reading its response "
                                         "before it is disconnected (its requests aborted)")
    keep_alive_timeout: float = setting(5.0, "seconds an idle keep-alive connection is kept "
                                             "open")
    max_connections: int = setting(1024, "open connections; a new one beyond this gets a "
                                         "429")

    def __post_init__(self) -> None:
        for name in ("header_timeout", "read_timeout", "write_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")

    @property
    def tick(self) -> float:
        """How often a connection's clock is looked at (a fifth of the shortest timeout)."""
        return min(1.0, max(0.02, min(self.header_timeout, self.read_timeout,
                                      self.write_timeout) / 5))


@dataclass
class ServerArgs:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(
        None, "model name clients use (default: the model's name)")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: "
              "$KVSERVE_API_KEY)", secret=True)
    max_waiting_requests: int | None = setting(
        None, "answer 429 when this many requests wait (default: unbounded)")
    max_request_bytes: int = setting(4 << 20, "largest request body, e.g. 4MiB (else 413)",
                                     flag="--max-request-size", parse=size_arg,
                                     metavar="SIZE")
    shutdown_timeout: float = setting(
        30.0, "seconds in-flight requests get to finish after SIGTERM")
    access_log: bool = setting(False, "log a line for each request (uvicorn's access log)",
                               negatable=True)
    enable_auto_tool_choice: bool = setting(
        False, 'let the model decide to call tools (tool_choice "auto"); needs '
               "--tool-call-parser")
    tool_call_parser: str | None = setting(
        None, "the model's tool-call format, for tool_choice auto: hermes (Qwen 2.5/3, "
              "Hermes; also fenced or bare JSON calls), qwen3_coder (Qwen3-Coder's XML), "
              "llama3_json (Llama 3.1/3.2), pythonic (Llama 3.2/4 Python-style lists), "
              "mistral ([TOOL_CALLS]), gpt-oss or harmony (gpt-oss's commentary-channel "
              "calls); auto: the one the chat template's markers show",
        choices=[*sorted(TOOL_PARSERS), "auto"])
    responses_store_size: int = setting(
        1000, "/v1/responses: the conversations kept for previous_response_id, the least "
              "recently used dropped first (0: none kept)")
    reasoning_parser: str | None = setting(
        None, "split the thinking into reasoning_content: <think>...</think> (deepseek_r1, "
              "qwen3), or harmony's analysis channel (gpt-oss, harmony: the default for a "
              "chat template that writes harmony)",
        choices=sorted(REASONING_PARSERS))
    pooling: str = setting(
        "mean", "/v1/embeddings: the mean of the final hidden states over the input's "
                "tokens, or the last token's; L2-normalised", choices=["mean", "last"])
    metrics_api_key: str | None = setting(
        None, "require this key for /metrics (default: public, aggregates only)",
        secret=True)
    limits: RequestLimits = field(default_factory=RequestLimits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """The server's flags, from the fields of ServerArgs and of its two limit groups."""
        add_fields_as_flags(cls, parser.add_argument_group("server"),
                            defaults={"api_key": os.environ.get("KVSERVE_API_KEY")})
        add_fields_as_flags(ConnectionLimits, parser.add_argument_group(
            "connections (slow and greedy clients)"))
        add_fields_as_flags(RequestLimits, parser.add_argument_group(
            "request limits (each a 400 naming the field)"))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        """By field name, so no two flags can be crossed."""
        return fields_from_flags(cls, ns, limits=fields_from_flags(RequestLimits, ns),
                                 connections=fields_from_flags(ConnectionLimits, ns))
