"""What a run shows and keeps: the log file (jsonl or csv), the console (a progress bar with ETA on a terminal,
plain lines when piped or in CI), and the loss plot."""
from __future__ import annotations

import json
import os
import sys
import time


class Logger:
    """Rows of ``{"step", "kind": "train"|"val", "loss", ...}`` appended to ``<out_dir>/log.jsonl`` (or .csv)."""

    KEYS = ["step", "kind", "loss", "lr", "grad_norm", "ms_per_step", "tok_per_s"]

    def __init__(self, out_dir, fmt, write=True):
        self.path = os.path.join(out_dir, "log." + ("csv" if fmt == "csv" else "jsonl"))
        self.fmt, self.rows, self._header, self.write = fmt, [], False, write
        if write:  # (write=False: the rows are kept in memory only -- the ranks other than 0 of a run)
            os.makedirs(out_dir, exist_ok=True)
            open(self.path, "w").close()

    def log(self, row):
        self.rows.append(row)
        if not self.write:
            return
        with open(self.path, "a") as f:
            if self.fmt == "csv":
                if not self._header:
                    f.write(",".join(self.KEYS) + "\n")
                    self._header = True
                f.write(",".join("" if row.get(k) is None else str(row.get(k)) for k in self.KEYS) + "\n")
            else:
                f.write(json.dumps(row) + "\n")

    def plot(self, out_dir):
        """``loss.png`` (train and val loss against step); None when matplotlib is missing."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        tr = [(r["step"], r["loss"]) for r in self.rows if r["kind"] == "train"]
        va = [(r["step"], r["loss"]) for r in self.rows if r["kind"] == "val"]
        fig, ax = plt.subplots(figsize=(6, 4))
        if tr:
            ax.plot(*zip(*tr), label="train")
        if va:
            ax.plot(*zip(*va), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, "loss.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path


def _fmt_time(s):
    s = int(max(0, s))
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Console:
    """The run's voice. ``mode``: "bar" redraws one status line with a bar and ETA (a terminal), "lines" prints
    each logged step as a line (pipes, CI, log files); "auto" picks by ``stream.isatty()``. ``quiet`` prints
    nothing."""

    def __init__(self, mode="auto", quiet=False, stream=None):
        self.stream = stream or sys.stdout
        self.quiet = quiet
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = (mode == "bar") or (mode == "auto" and tty)
        self._open = False
        self.t0 = time.perf_counter()

    def say(self, msg):
        if self.quiet:
            return
        if self._open:
            self.stream.write("\n")
            self._open = False
        print(msg, file=self.stream, flush=True)

    def step(self, step, total, start, line):
        """A train log line at optimizer step ``step`` of ``total`` (this session began at ``start``)."""
        if self.quiet:
            return
        if not self.bar:
            print(line, file=self.stream, flush=True)
            return
        done = step - start
        el = time.perf_counter() - self.t0
        eta = el / done * (total - step) if done else 0.0
        width = 24
        fill = int(width * step / max(total, 1))
        bar = "#" * fill + "-" * (width - fill)
        self.stream.write(f"\r[{bar}] {line} | {_fmt_time(el)}<{_fmt_time(eta)}\x1b[K")
        self.stream.flush()
        self._open = True

    def close(self):
        if self._open and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
        self._open = False
