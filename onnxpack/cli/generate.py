"""``onnxpack generate DIR --prompt TEXT | --ids 1,2,3``: generate tokens with a builder model folder.

Prints the tokens (or text, with the optional ``tokenizers`` package) as they come, then one line
of figures: time to first token, tokens/s after it, and the process's private and shared memory.
"""

from __future__ import annotations

import argparse
import sys
import time

from onnxpack.cli._common import EXIT_OK, format_bytes, int_at_least, parse_config
from onnxpack.errors import InvalidArgument

__all__ = ["HELP", "add_arguments", "run"]

HELP = "generate tokens with a model folder written by onnxruntime-genai's builder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="folder with genai_config.json, model.onnx and tokenizer files")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the tokenizers package)")
    src.add_argument("--ids", help="prompt token ids, comma-separated (no tokenizer needed)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--max-length", type=int_at_least(2), default=None,
                   help="prompt + generated tokens at most (default: genai_config's max_length)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy argmax")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int_at_least(0), default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop", default="", help="extra stop token ids, comma-separated")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="session config entry (repeatable), e.g. onnxpack.prepacked_cache_path=cache.bin")


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InvalidArgument(f"{flag}: expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from onnxpack.generate import Generator
    from onnxpack.session import SessionOptions
    from onnxpack.session import process_memory

    so = SessionOptions()
    for key, value in parse_config(args.config).items():
        so.add_session_config_entry(key, value)
    t0 = time.perf_counter()
    gen = Generator(args.folder, so, max_length=args.max_length)
    create = time.perf_counter() - t0
    with gen:
        ids = _ids(args.ids, "--ids") if args.ids is not None else gen.encode(args.prompt)
        search = gen.config.search
        changes = {"do_sample": args.sample or search.do_sample}
        for name in ("temperature", "top_k", "top_p"):
            if getattr(args, name) is not None:
                changes[name] = getattr(args, name)
        search = dataclasses.replace(search, **changes)
        text = args.prompt is not None
        out = sys.stdout
        times: list[float] = []
        tokens: list[int] = []
        shown = ""
        t_start = time.perf_counter()
        for tok in gen.generate(ids, max_new_tokens=args.max_new_tokens, search=search,
                                stop=_ids(args.stop, "--stop"), seed=args.seed,
                                on_step=lambda _t, s: times.append(s)):
            tokens.append(tok)
            if text:
                now = gen.decode(tokens)
                out.write(now[len(shown):])
                shown = now
            else:
                out.write(f"{tok} ")
            out.flush()
        total = time.perf_counter() - t_start
        out.write("\n")
        mem = process_memory()
        rate = (len(times) - 1) / sum(times[1:]) if len(times) > 1 else 0.0
        print(f"prompt {len(ids)} tokens, generated {len(tokens)} in {total:.2f} s; create {create * 1e3:.0f} ms, "
              f"time to first token {times[0] * 1e3 if times else 0:.0f} ms, {rate:.1f} tokens/s after it; "
              f"memory: private {format_bytes(mem.get('RssAnon', 0))}, file-backed {format_bytes(mem.get('RssFile', 0))}, "
              f"PSS {format_bytes(mem.get('Pss', 0))}", file=sys.stderr)
    return EXIT_OK
