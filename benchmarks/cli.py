"""``phloem bench``: serving (HTTP load generator), offline (in-process Engine), one-batch (static batch).

See docs/benchmarks.md for what each reports and how to read it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def build_parser() -> argparse.ArgumentParser:
    from phloem.bench.offline import add_offline_args
    from phloem.bench.one_batch import add_one_batch_args
    from phloem.bench.serving import add_serving_args

    parser = argparse.ArgumentParser(prog="phloem bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    add_serving_args(
        sub.add_parser("serving", help="load-test a running server over HTTP", formatter_class=fmt)
    )
    add_offline_args(
        sub.add_parser("offline", help="a dataset through an in-process Engine", formatter_class=fmt)
    )
    add_one_batch_args(
        sub.add_parser(
            "one-batch", help="prefill and decode-step time of a static batch", formatter_class=fmt
        )
    )
    return parser


def _handler(name: str) -> Callable[..., int]:
    if name == "serving":
        from phloem.bench.serving import main
    elif name == "offline":
        from phloem.bench.offline import main
    else:
        from phloem.bench.one_batch import main
    return main


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(_handler(ns.bench)(ns, argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
