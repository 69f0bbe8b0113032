"""The ``dlpipe`` command: subcommands, each a small handler; ``main(argv) -> int``.

Bad input exits 2 with one ``error:`` line that says what is wrong and how to fix it (a bad
flag value too: the parser prints one line, not a usage block); a check that finds problems
(``verify``) exits 1; Ctrl-C exits 130 with one ``interrupted`` line. Warnings logged on the
``dlpipe`` logger while a command runs are printed as ``warning:`` lines on stderr. Text that
came from a user or a dataset (paths, class, split and field names, error messages) is printed
escaped, never read as rich markup, and with no terminal control character in it (`printable`:
an ESC that would clear the screen or retitle the window, a CR or backspace that would overwrite
an earlier line, a bidi override that would reorder it are shown as ``\\x1b``, ``\\u202e``...):
every ``error:``/``warning:`` line is escaped where it is printed, and so is everything the
commands print through their rich `Console` (`TerminalConsole`). What dlpipe writes to files
(the manifest, ``errors.jsonl``) keeps the names as they are: they are data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NoReturn

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment

from dlpipe._version import __version__
from dlpipe.errors import DlpipeError
from dlpipe.text import Interrupted, printable, shown

__all__ = ["ArgumentParser", "TerminalConsole", "main"]

Handler = Callable[[argparse.Namespace, Console], int]
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


class TerminalConsole(Console):
    """A rich `Console` that writes no control character it was not asked to: the text of
    everything it renders is `printable` (line breaks kept), whatever the caller escaped;
    rich's own styles and cursor moves are not text, and pass."""

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or segment.text.isprintable():
                yield segment
            else:
                yield Segment(printable(segment.text, keep="\n"), segment.style)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad command line reported as one ``error:`` line (exit 2).

    The line names the flag, the value and the rule, and points at ``--help``, instead of
    argparse's usage block; every subcommand's parser is one of these.
    """

    def error(self, message: str) -> NoReturn:
        print(printable(f"error: {message}; see {self.prog} --help"), file=sys.stderr)
        raise SystemExit(2)


def _doctor(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.doctor import Probe, data_checks, print_checks, run_checks, to_json

    probe = Probe(data_dir=args.data_dir) if args.data_dir else Probe()
    checks = run_checks(probe) + (data_checks(args.data) if args.data else [])
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
        console.print(f"[red]problem[/red] {shown(problem)}")
    what = f"{report.shards_checked} shards" + (
        f", {report.samples_decoded} samples decoded" if args.decode else ""
    )
    data = shown(args.data)
    if report.ok:
        console.print(f"ok: {data}: {what}, every sha256 and sample count matches the manifest")
        return 0
    console.print(f"[red]FAILED[/red]: {data}: {len(report.problems)} problems in {what}")
    return 1


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="dlpipe", description="Raw training data to verified shards to a training GPU."
    )
    parser.add_argument("--version", action="version", version=f"dlpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from dlpipe.demo import add_demo_parser

    add_demo_parser(sub)

    doctor = sub.add_parser("doctor", help="check the machine: GPUs, drivers, memory, disks")
    doctor.add_argument(
        "--data-dir", help="where datasets live (default: $DLPIPE_DATA_DIR, else here)"
    )
    doctor.add_argument(
        "--data", help="also check a dataset's storage (URL or folder): reach, manifest, speed"
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


class _WarningLines(logging.Handler):
    """``dlpipe`` logger warnings as ``warning: <message>`` lines on the current stderr, one
    line each (`printable`)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a malformed log call must not end the command
            text = str(record.msg)
        level = "warning" if record.levelno < logging.ERROR else "error"
        print(f"{level}: {printable(text)}", file=sys.stderr)


@contextlib.contextmanager
def _warnings_printed() -> Iterator[None]:
    logger, handler = logging.getLogger("dlpipe"), _WarningLines()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _run(handler: Handler, args: argparse.Namespace, console: Console) -> int:
    try:
        return handler(args, console)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback
        line = exc.args[0] if isinstance(exc, Interrupted) and exc.args else "interrupted"
        print(printable(str(line)), file=sys.stderr)
        return EXIT_INTERRUPTED
    except (DlpipeError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {printable(str(message))}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions, a vanished file: the OS names it
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dlpipe`` command; returns its exit code.

    Raises:
        SystemExit: for ``--help``/``--version`` (0) and a bad command line (2, after one
            ``error:`` line), as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while torch and friends import
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    args.argv = argv  # a handler that re-launches itself (train --nproc-per-node) repeats it
    console = TerminalConsole(highlight=False, soft_wrap=True)
    with _warnings_printed():
        return _run(args.handler, args, console)


if __name__ == "__main__":
    sys.exit(main())
