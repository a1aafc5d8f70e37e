"""`kvserve generate` and `kvserve chat`: one prompt, or a conversation, on the terminal."""

from __future__ import annotations

import argparse
import sys

from kvserve.entrypoints.cli.common import (
    add_engine_args,
    add_sampling_args,
    engine_from,
    sampling_params_from,
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the chat template")
    g.add_argument("--n", type=int, default=1, help="number of samples")
    g.add_argument("--logprobs", type=int, default=None,
                   help="print the top-N logprobs of every generated token")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=128)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive conversation with the model")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)


def stream(engine, request_id: str, out=None) -> object:
    """Run the engine until `request_id` (added with OutputKind.DELTA) finishes, printing
    sample 0's text as it comes (to `out`, by default the sys.stdout of the call); returns
    the last output with every sample's text, token ids and logprobs put back together."""
    out = out or sys.stdout
    final = None
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list] = {}
    try:
        while final is None:
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                out.write(o.outputs[0].delta_text)
                out.flush()
                for c in o.outputs:
                    texts.setdefault(c.index, []).append(c.delta_text)
                    ids.setdefault(c.index, []).extend(c.delta_token_ids)
                    if c.logprobs is not None:
                        lps.setdefault(c.index, []).extend(c.logprobs)
                if o.finished:
                    final = o
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        engine.step()
        out.write("\n[interrupted]\n")
        raise
    for c in final.outputs:
        c.text, c.token_ids = "".join(texts[c.index]), ids[c.index]
        if c.logprobs is not None:
            c.logprobs = lps[c.index]
    return final


def report(final, file=None) -> None:
    file = file or sys.stderr
    m = final.metrics
    n = m.num_generation_tokens
    parts = [f"{m.num_prompt_tokens} prompt + {n} generated tokens",
             f"finish: {', '.join(str(c.finish_reason) for c in final.outputs)}"]
    if m.ttft is not None:
        parts.append(f"queue {m.queue_time * 1e3:.0f} ms, TTFT {m.ttft * 1e3:.0f} ms")
    if m.tpot:
        parts.append(f"TPOT {m.tpot * 1e3:.1f} ms ({1 / m.tpot:.1f} tok/s)")
    print(f"[{'; '.join(parts)}]", file=file)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.outputs import OutputKind

    engine = engine_from(args)
    params = sampling_params_from(args, n=args.n, logprobs=args.logprobs)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = args.prompt
    rid = engine.add_request("cli", prompt, params, output_kind=OutputKind.DELTA)
    if not args.chat:
        sys.stdout.write(args.prompt)
    final = stream(engine, rid)
    sys.stdout.write("\n")
    for c in final.outputs[1:]:
        sys.stdout.write(f"--- sample {c.index} ---\n{c.text}\n")
    if args.logprobs is not None:
        for c in final.outputs:
            for lp in c.logprobs or []:
                tok = engine.tokenizer.decode([lp.token_id], skip_special_tokens=False)
                top = ", ".join(f"{engine.tokenizer.decode([t], skip_special_tokens=False)!r}:"
                                f"{p:.3f}" for t, p in lp.top)
                print(f"  {tok!r} {lp.logprob:.3f} rank {lp.rank} [{top}]", file=sys.stderr)
    report(final)
    engine.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = engine_from(args)
    try:
        return chat_loop(engine, args)
    finally:
        engine.close()


def chat_loop(engine, args: argparse.Namespace) -> int:
    from kvserve.outputs import OutputKind

    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: /reset clears the conversation, /exit or Ctrl-D quits.",
          file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        try:
            rid = engine.add_request(f"chat-{turn}", ids, sampling_params_from(args),
                                     output_kind=OutputKind.DELTA)
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        turn += 1
        try:
            final = stream(engine, rid)
        except KeyboardInterrupt:
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": final.outputs[0].text})
        if args.verbose:
            report(final)
