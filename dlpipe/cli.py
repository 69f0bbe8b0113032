"""The ``dlpipe`` command: subcommands, each a small handler; ``main(argv) -> int``.

Bad input exits 2 with one ``error:`` line that says what is wrong and how to fix it; a check
that finds problems (``verify``) exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from dlpipe._version import __version__
from dlpipe.errors import DlpipeError

__all__ = ["main"]

Handler = Callable[[argparse.Namespace, Console], int]


def _demo(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.demo import DemoConfig, default_demo_dir, run_demo

    config = DemoConfig(
        out=args.out or default_demo_dir(),
        per_class=args.per_class,
        seed=args.seed,
        epochs=args.epochs,
        model=args.model,
    )
    return run_demo(config, console)


def _doctor(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.doctor import Probe, print_checks, run_checks, to_json

    probe = Probe(data_dir=args.data_dir) if args.data_dir else Probe()
    checks = run_checks(probe)
    if args.json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        print_checks(checks, console)
    return 1 if any(c.status == "problem" for c in checks) else 0


def _inspect(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.inspection import describe_dataset, print_description

    info = describe_dataset(args.data)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_description(info, console)
    return 0


def _verify(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.verify import verify_dataset

    report = verify_dataset(args.data, decode=args.decode)
    for problem in report.problems:
        console.print(f"[red]problem[/red] {problem}", highlight=False)
    what = f"{report.shards_checked} shards" + (
        f", {report.samples_decoded} samples decoded" if args.decode else ""
    )
    if report.ok:
        console.print(f"ok: {args.data}: {what}, every sha256 matches the manifest")
        return 0
    console.print(f"[red]FAILED[/red]: {args.data}: {len(report.problems)} problems in {what}")
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlpipe", description="Raw training data to verified shards to a training GPU."
    )
    parser.add_argument("--version", action="version", version=f"dlpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run dlpipe end to end on the embedded shapes dataset")
    demo.add_argument(
        "--out", help="folder for the demo (default: $DLPIPE_DATA_DIR/dlpipe-demo or ./dlpipe-demo)"
    )
    demo.add_argument(
        "--per-class",
        type=_positive_int,
        default=400,
        help="images per class (8 classes; default 400)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--epochs", type=int, default=12, help="training epochs (12; 0 converts and verifies only)"
    )
    demo.add_argument("--model", default="resnet18", help="torchvision model to train")
    demo.set_defaults(handler=_demo)

    doctor = sub.add_parser("doctor", help="check the machine: GPUs, drivers, memory, disks")
    doctor.add_argument(
        "--data-dir", help="where datasets live (default: $DLPIPE_DATA_DIR, else here)"
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(handler=_doctor)

    inspect = sub.add_parser("inspect", help="show a dataset's format, splits, fields, classes")
    inspect.add_argument("data", help="dataset folder or URL")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.set_defaults(handler=_inspect)

    from dlpipe.converters.command import add_convert_parser

    add_convert_parser(sub)

    from dlpipe.tune_command import add_bench_parser

    add_bench_parser(sub)

    from dlpipe.train.command import add_train_parser

    add_train_parser(sub)

    verify = sub.add_parser("verify", help="check every shard's sha256 (and decode with --decode)")
    verify.add_argument("data", help="dataset folder or URL")
    verify.add_argument("--decode", action="store_true", help="also decode every sample")
    verify.set_defaults(handler=_verify)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # a handler that re-launches itself (train --nproc-per-node) repeats it
    console = Console(highlight=False, soft_wrap=True)
    handler: Handler = args.handler
    try:
        return handler(args, console)
    except (DlpipeError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions, a vanished file: the OS names it
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
