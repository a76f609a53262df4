"""The rule every command line here keeps (``python -m cukernels.train``, ``python -m cukernels.sample``,
``python -m cukernels.export``): a user error -- a bad argument, config key, path or file -- is one line on stderr,
``error: <what> ...: <the fix>``, and exit code 2; a traceback means a bug. ``--debug`` shows the traceback of
either.
"""
from __future__ import annotations

import sys


class UsageError(Exception):
    """A command-line argument that cannot work; the message names it and says what would."""


def add_debug(ap):
    """The ``--debug`` flag on an ``argparse`` parser."""
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error (a user error is "
                                                         "otherwise one line)")


def one_line(e) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run(body, *, debug=False, user_errors=(), interrupted=None) -> int:
    """``body()``'s exit code (None: 0); a ``UsageError`` or one of ``user_errors`` (exception classes) printed as
    one line, exit code 2 (with ``debug``: raised, traceback and all). ``interrupted``: the line printed on Ctrl-C
    (exit code 130)."""
    try:
        rc = body()
    except (UsageError, *user_errors) as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("\n" + (interrupted or "interrupted"), file=sys.stderr)
        return 130
    return 0 if rc is None else int(rc)
