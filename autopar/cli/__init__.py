"""The ``autopar`` command line.

One subcommand per module named in ``COMMANDS`` (``import_config`` is the
``import`` command: ``import`` is Python's keyword); each module defines
``register(subparsers)``, which adds its parser and sets ``func=run`` where
``run(args) -> int`` returns the exit code.  Command modules are imported
when the parser is built, so they must import heavy dependencies (ray,
optuna, pandas) inside ``run``, not at module level.

Exit codes: 0 success, 1 the command ran but the answer is negative (e.g. an
infeasible layout), 2 bad input (one line naming the file and the field),
130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from autopar.io.specs import SpecError

COMMANDS: tuple[str, ...] = ("estimate", "exhaustive", "validate", "compare", "tune", "run",
                             "codesign", "calibrate", "report", "advise",
                             "import_config", "list")

# the subcommand a module registers, where it is not the module's name
# (``import`` is Python's keyword)
COMMAND_OF: dict[str, str] = {"import_config": "import"}

# An example for each command's --help (its epilog): lines that run as they
# are from a clone or an installed autopar (tests/test_cli_help.py parses each).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "estimate": ("autopar exhaustive models/gpt3-175B.json systems/a100_80g.json --num-procs 64 "
                 "--max-batch-size 64 --datatype float16 --output best.json",
                 "autopar estimate models/gpt3-175B.json systems/a100_80g.json best.json"),
    "exhaustive": ("autopar exhaustive models/gpt3-175B.json systems/a100_80g.json --num-procs 64 "
                   "--max-batch-size 64 --datatype float16 --space small --output best.json",),
    "validate": ("autopar validate megatron", "autopar validate published --table nemo_h100",
                 "autopar validate recipes --family llama3"),
    "compare": ("autopar compare experiments/compare-quick.yaml --output-dir compare-out",),
    "tune": ("autopar tune models/gpt3-175B.json systems/a100_80g.json --num-procs 1024 "
             "--max-batch-size 1536 --datatype float16 --sampler skeleton-tpe --trials 50 "
             "--seed 0 --output best.json",),
    "run": ("autopar run experiments/exhaustive-gpt3-175b-1024-a100.yaml",),
    "codesign": ("autopar codesign experiments/codesign-small.yaml",),
    "calibrate": ("autopar calibrate SWEEP.csv --system systems/a100_80g_dgx_hdr200_base.json "
                  "--framework megatron-core --system-output hw.json --output calibrated.json",),
    "list": ("autopar list models", "autopar list spaces"),
    "report": ("autopar exhaustive models/gpt3-175B.json systems/a100_80g.json --num-procs 64 "
               "--max-batch-size 64 --datatype float16 --space small --top top.json",
               "autopar report top.json --output page.html"),
    "advise": ("autopar advise models/gpt3-175B.json systems/a100_80g.json --from my-run.sh "
               "--format megatron --config-out better.sh",),
    "import": ("autopar import train.toml --format torchtitan --num-procs 64 "
                      "--model-out model.json --execution-out execution.json",),
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that indented lines (the examples) are kept
    as written instead of being run into one paragraph."""

    def _fill_text(self, text, width, indent):
        return "\n".join(indent + line if line.startswith("  ") or not line.strip()
                         else super(HelpFormatter, self)._fill_text(line, width, indent)
                         for line in text.split("\n"))


def version() -> str:
    """autopar's version, from the installed package's metadata."""
    from importlib import metadata
    try:
        return metadata.version("autopar")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: run from a clone without pip install)"


SOURCE = "command line"    # what SpecError names for a bad argument


# Counts beyond these are not layouts anyone runs, and the divisor searches
# over them would take hours (processors, batch) or overflow 64-bit columns.
from autopar.io.errors import MAX_BATCH, MAX_PROCS  # noqa: E402

LIMITS = {"--num-procs": MAX_PROCS, "--max-batch-size": MAX_BATCH, "--trials": 1 << 31,
          "--top-n": 1 << 31, "--chunk-size": 1 << 31, "--concurrency": 1 << 16,
          "--workers": 1 << 12}
SEED_MAX = 2 ** 32 - 1             # numpy's and Optuna's samplers take 32-bit seeds


def framework_option(p) -> None:
    """The ``--framework NAME|PATH`` option every command that runs the model takes."""
    p.add_argument("--framework", default=None, metavar="NAME|PATH",
                   help="training framework spec (a file of frameworks/ by name, e.g. "
                        "megatron-core, or a path): its memory/time records replace the "
                        "system's, its recipe defaults fill unstated execution fields "
                        "(default: none, the system file's own records)")


def inference_option(p) -> None:
    """The ``--inference`` option every command that searches layouts takes."""
    p.add_argument("--inference", action="store_true",
                   help="lay out inference instead of training (the layouts' training "
                        "field false: no backward pass, optimizer, gradients or recompute)")


def training_of(args) -> bool:
    """Whether a command's layouts train (``--inference`` not given; an
    experiment file's ``case.training``)."""
    return not getattr(args, "inference", False)


def positive(name: str, v) -> None:
    """A count given on the command line must be at least 1 (None: not given)
    and at most ``LIMITS[name]``."""
    if v is not None and v < 1:
        raise SpecError(SOURCE, name, f"must be a positive integer, got {v}")
    hi = LIMITS.get(name)
    if v is not None and hi is not None and v > hi:
        raise SpecError(SOURCE, name, f"must be at most {hi:,}, got {v}")


def seed_arg(name: str, v) -> None:
    if v is not None and not 0 <= v <= SEED_MAX:
        raise SpecError(SOURCE, name, f"must be between 0 and 2**32-1, got {v}")


def output_path(name: str, path: str | None):
    """An output file argument that can be written, or None: its folder exists
    and is writable, and it is not a folder, a device or a FIFO (a symlink
    names the file it points to).  Checked before any work."""
    import os
    from pathlib import Path
    if path is None:
        return None
    p = Path(path)
    try:
        os.stat(p)
    except OSError as e:
        import errno
        if e.errno == errno.ELOOP:
            raise SpecError(SOURCE, name, f"{path} is a symlink loop") from None
    if os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p):
        raise SpecError(SOURCE, name, f"{path} is not a regular file (a device, FIFO, pipe "
                        "or socket); autopar writes whole files only")
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    if p.is_dir():
        raise SpecError(SOURCE, name, f"{path} is a directory")
    if p.exists() and not p.is_file():
        raise SpecError(SOURCE, name, f"{path} is not a regular file (a device, FIFO or "
                        "socket); autopar writes whole files only")
    if not p.parent.is_dir():
        raise SpecError(SOURCE, name, f"directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise SpecError(SOURCE, name, f"cannot write into {p.parent}")
    return p


def distinct_outputs(outs: dict) -> None:
    """Two output options naming one file would overwrite each other."""
    seen: dict = {}
    for name, p in outs.items():
        if p is None:
            continue
        try:
            key = p.resolve()
        except (RuntimeError, OSError):     # a symlink loop names no file
            raise SpecError(SOURCE, name, f"{p} is a symlink loop") from None
        if key in seen:
            raise SpecError(SOURCE, name, f"{p} is also {seen[key]}'s file")
        seen[key] = name


class Parser(argparse.ArgumentParser):
    """argparse with autopar's one-line errors: a bad option or value ends
    with one line naming it and exit 2, not the whole usage text (``-h``
    still prints it).  Subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, error_line(SpecError(SOURCE, self.prog, f"{message} (see: {self.prog} -h)"))
                  + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="autopar", formatter_class=HelpFormatter,
        description="Plan large-model training layouts with an analytical "
                    "performance model (Calculon's method).",
        epilog="examples:\n  autopar list models\n  " + EXAMPLES["exhaustive"][0]
               + "\n  autopar COMMAND --help")
    parser.add_argument("--version", action="version", version=f"autopar {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"autopar.cli.{name}").register(sub)
        command = COMMAND_OF.get(name, name)
        p = sub.choices[command]
        p.formatter_class = HelpFormatter
        lines = EXAMPLES.get(command, ())
        p.epilog = "\n".join([p.epilog or "", "example:" if len(lines) == 1 else "examples:",
                              *(f"  {line}" for line in lines)]).lstrip("\n") if lines else p.epilog
    return parser


def error_line(err: SpecError) -> str:
    """The one line printed for bad input."""
    text = f"autopar: error: {err.source}: {err.field}: {err.message}"
    return " ".join(text.split())   # never more than one line


def _refuse_without_stdout() -> None:
    if stdout_gone():
        raise BrokenPipeError("stdout closed by its reader")


def _terminated(signum, frame):
    raise KeyboardInterrupt       # SIGTERM ends a run as an interrupt does: nothing half-written


def entry() -> int:
    """The ``autopar`` command (and ``python -m autopar.cli``): ``main`` in a
    process whose string hashing is fixed (``PYTHONHASHSEED=0`` unless the
    environment sets it), so that a seeded search repeats exactly from one
    run to the next: SMAC keeps its configurations in hash-ordered sets, and
    a configuration's hash is that of its text."""
    import os
    if os.name == "posix" and "PYTHONHASHSEED" not in os.environ:
        env = dict(os.environ, PYTHONHASHSEED="0")
        try:
            # the same command line, interpreter options (-W, -X) included
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
        except OSError:         # cannot start again: run as we are
            pass
    try:
        return main()
    except KeyboardInterrupt:   # a second interrupt while the first was being handled
        _ignore_interrupts()
        print("autopar: interrupted", file=sys.stderr)
        return 130


def _ignore_interrupts() -> None:
    """Once a run is ending on an interrupt, further SIGINT/SIGTERM do not cut
    its clean-up short (nor kill the process by the signal: exit stays 130)."""
    import signal
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(s, signal.SIG_IGN)
        except ValueError:        # not the main thread
            pass


def stdout_gone() -> str | None:
    """Why standard output cannot take the answer, or None: closed at start
    (``>&-``), or a pipe whose reader has gone away (``| true``; poll says
    POLLERR for such a pipe's writer).  Checked before any work and before
    each output file is put in place, so that a run whose answer cannot be
    printed leaves nothing behind."""
    import io
    import os
    import select
    import stat as stat_
    if sys.stdout is None:
        return "closed"
    try:
        fd = sys.stdout.fileno()
    except (io.UnsupportedOperation, AttributeError):
        return None              # a replaced stdout (tests, notebooks): not ours to judge
    except (OSError, ValueError):
        return "closed"
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return "closed"
    if not stat_.S_ISFIFO(mode) or not hasattr(select, "poll"):
        return None
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if any(ev & select.POLLERR for _, ev in poller.poll(0)):
        return "closed by its reader"
    return None


def main(argv: list[str] | None = None) -> int:
    import signal
    from autopar.io import writers
    parser = build_parser()
    args = parser.parse_args(argv)
    gone = stdout_gone()
    if gone:
        print(f"autopar: error: stdout: {gone}", file=sys.stderr)
        return 2
    writers.before_commit = _refuse_without_stdout
    try:
        signal.signal(signal.SIGTERM, _terminated)
    except ValueError:            # not the main thread
        pass
    try:
        # every output of the command is put in place when it succeeds, none
        # (nor a folder made for them) when it fails
        with writers.all_or_nothing():
            code = int(args.func(args) or 0)
            sys.stdout.flush()    # a closed pipe shows here, not at exit
        return code
    except SpecError as err:
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _ignore_interrupts()
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away: say so once on stderr, print nothing more
        import os
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        print("autopar: error: stdout: closed by its reader", file=sys.stderr)
        return 2
    except OSError as err:        # a full disk, a file that cannot be written
        where = err.filename or "output"
        print(f"autopar: error: {where}: (file): cannot write: "
              f"{err.strerror or err}", file=sys.stderr)
        return 2
