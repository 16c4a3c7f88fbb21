"""``phloem`` command line: serve, router, generate, bench, doctor, train-eagle.

Engine flags are generated from ``EngineArgs`` fields, so ``phloem serve --help`` lists every
option with the same names the ``Engine(**config)`` keywords use.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the command, and where to read its options (argparse
    would print the whole usage first: some fifty lines for ``serve``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def _engine_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    from phloem.runtime.config import EngineArgs

    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    EngineArgs.add_cli_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="phloem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _engine_parser(sub, "serve", "start the HTTP server")

    r = sub.add_parser(
        "router", help="route requests over several phloem serve workers",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    from phloem.runtime.router.config import RouterArgs

    RouterArgs.add_cli_args(r)

    g = _engine_parser(sub, "generate", "generate one completion and print it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")

    b = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    b.add_argument("rest", nargs=argparse.REMAINDER)

    d = sub.add_parser("doctor", help="replay a workload, read the server's gauges, suggest flags", add_help=False)
    d.add_argument("rest", nargs=argparse.REMAINDER)

    t = sub.add_parser("train-eagle", help="train an EAGLE draft head for a target model", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def cmd_generate(ns: argparse.Namespace) -> int:
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.engine import Engine

    args = EngineArgs.from_cli(ns)
    if args.log_level == "info":
        args = args.replace(log_level="warning")
    with Engine(**args.to_dict()) as engine:
        prompt = ns.prompt
        if ns.chat:
            prompt = engine.tm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p}
        if ns.stream:
            shown = 0
            for chunk in engine.generate(prompt, sampling_params=params, stream=True):
                sys.stdout.write(chunk["text"][shown:])
                sys.stdout.flush()
                shown = len(chunk["text"])
            sys.stdout.write("\n")
            return 0
        out = engine.generate(prompt, sampling_params=params)
        reason = out["meta_info"]["finish_reason"]
        if reason and reason.get("type") == "abort":
            print(f"error: {reason.get('message')}", file=sys.stderr)
            return 1
        print(out["text"])
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.server.app import run_server

    args = EngineArgs.from_cli(ns)
    if args.node_rank > 0:  # a further node of a multi-node tensor-parallel engine: no server here
        from phloem.runtime.launch import run_follower_node

        return run_follower_node(args)
    if args.dp_size > 1:  # N workers behind the router
        from phloem.runtime.router.dp import run_data_parallel

        return run_data_parallel(args)
    return int(run_server(args) or 0)


def cmd_router(ns: argparse.Namespace) -> int:
    from phloem.runtime.router.app import run_router
    from phloem.runtime.router.config import RouterArgs

    return run_router(RouterArgs.from_cli(ns))


def cmd_bench(ns: argparse.Namespace) -> int:
    from phloem.bench.cli import main as bench_main

    return int(bench_main(ns.rest) or 0)


def cmd_doctor(ns: argparse.Namespace) -> int:
    from phloem.bench.doctor import main as doctor_main

    return int(doctor_main(ns.rest) or 0)


def cmd_train_eagle(ns: argparse.Namespace) -> int:
    from phloem.training.eagle_head import train_eagle_main

    return int(train_eagle_main(ns.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("bench", "doctor", "train-eagle"):
        # these own their flags: argparse's REMAINDER refuses a remainder that starts with an option
        ns = argparse.Namespace(command=args[0], rest=args[1:])
    else:
        parser = build_parser()
        ns, unknown = parser.parse_known_args(args)
        if unknown:  # named by the subcommand, whose options the user was writing
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[ns.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    handlers = {
        "generate": cmd_generate,
        "serve": cmd_serve,
        "router": cmd_router,
        "bench": cmd_bench,
        "doctor": cmd_doctor,
        "train-eagle": cmd_train_eagle,
    }
    try:
        return handlers[ns.command](ns)
    except (FileNotFoundError, ValueError) as e:  # bad model path or option: one clear line
        print(f"phloem: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an install without the runtime's dependencies
        if ns.command in ("bench", "doctor") or not e.name or e.name.startswith("phloem"):
            raise
        print(
            f"phloem {ns.command}: error: the module {e.name!r} is missing; the runtime needs its extra: "
            "pip install 'phloem[runtime]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
