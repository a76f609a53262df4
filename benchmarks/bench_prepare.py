"""Data preparation speed: ``python -m cukernels.data prepare`` in MB of text a second, the FastEncoder against the
tokenizers package's own encode_batch, on a cache-friendly text and on texts whose vocabulary keeps growing.

    python benchmarks/bench_prepare.py [--mb 64] [--short-mb 8] [--workers 2] [--json FILE]

Inputs (written to a temporary folder, seeded):

* ``repeated``: tinyshakespeare over and over, each copy with its lines shuffled and one word in twenty upper- or
  title-cased (the issue's "tinyshakespeare repeated with variations"): few new pre-tokens after the first MB;
* ``mixed``: the words (space-separated pieces) of tinyshakespeare, the project's docs, the installed packages'
  READMEs and docs and this Python's standard library sources (~50 MB of English and code), in a random order, 4-24
  a line: realistic vocabulary growth -- new pre-tokens keep coming (~4,000 a MB after 12 MB);
* ``code``: the standard library's lines in a random order (indentation kept).

Tokenizers: ``gpt2-512`` (tests/fixtures/tokenizer_shakespeare: GPT-2's ByteLevel pre-tokenizer, 512 tokens) and
``llama3-32k`` (Llama-3's Split pattern + ByteLevel, 32768 tokens, trained here on 8 MB of ``mixed`` in seconds).

Rows, each prepare() in a fresh process with ``--workers`` worker processes: on the first ``--short-mb`` MB of each
input the FastEncoder (``fast=True``) and the tokenizers package (``fast=False``, what prepare did before), their
outputs compared token for token (``equal``); then the FastEncoder on the whole ``--mb`` MB (the caches warm up over
the first ~10 MB a worker, so the longer file is closer to a gigabyte's rate). Columns: wall MB/s of text, the CPU
seconds of the parent and its workers, MB a CPU second (what a busy machine changes least), peak RSS of a process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cukernels import data as D  # noqa: E402

SHAKESPEARE = ROOT / "examples" / "data" / "tinyshakespeare.txt"
FIXTURE = ROOT / "tests" / "fixtures" / "tokenizer_shakespeare"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")


def write_repeated(path: Path, mb: float, seed: int = 0):
    rng = random.Random(seed)
    lines = SHAKESPEARE.read_text(encoding="utf-8").split("\n")
    size, limit = 0, int(mb * 2**20)
    with open(path, "w", encoding="utf-8") as f:
        while size < limit:
            copy = lines[:]
            rng.shuffle(copy)
            for line in copy:
                words = line.split(" ")
                for i in range(len(words)):
                    r = rng.random()
                    if r < 0.025:
                        words[i] = words[i].upper()
                    elif r < 0.05:
                        words[i] = words[i].title()
                line = " ".join(words) + "\n"
                f.write(line)
                size += len(line.encode("utf-8"))
                if size >= limit:
                    break


def _read(paths) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def _stdlib_sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]


def _prose_sources() -> list[Path]:
    """tinyshakespeare, the project's docs, and the installed packages' READMEs and docs (METADATA, .md, .rst, .txt)."""
    out = [SHAKESPEARE, *sorted((ROOT / "docs").glob("*.md"))]
    for sp in sorted({Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}):
        out += [p for p in sorted(sp.rglob("*")) if p.suffix in (".md", ".rst", ".txt") or p.name == "METADATA"]
    return out


def write_mixed(path: Path, mb: float, seed: int = 0):
    """Words (space-separated pieces) of the prose and the standard library's sources in a random order, 4-24 a
    line, a blank line now and then: the vocabulary of ~50 MB of English and code, met in a random order."""
    rng = random.Random(seed)
    words = [w for t in _read(_prose_sources() + _stdlib_sources()) for w in t.split()]
    rng.shuffle(words)
    size, limit, k = 0, int(mb * 2**20), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < limit:
            n = rng.randint(4, 24)
            line = " ".join(words[k % len(words)] for k in range(k, k + n)) + ("\n\n" if rng.random() < 0.1 else "\n")
            k += n
            f.write(line)
            size += len(line.encode("utf-8"))


def write_code(path: Path, mb: float, seed: int = 0):
    """Lines of the standard library's sources in a random order (indentation kept)."""
    rng = random.Random(seed)
    lines = [line for t in _read(_stdlib_sources()) for line in t.split("\n")]
    rng.shuffle(lines)
    size, limit, k = 0, int(mb * 2**20), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < limit:
            line = lines[k % len(lines)] + "\n"
            k += 1
            f.write(line)
            size += len(line.encode("utf-8"))


def train_llama3(folder: Path, text_file: Path, vocab: int = 32768):
    """A Llama-3-style tokenizer (the Split pattern + ByteLevel without its regex, 256 reserved specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    tok.train([str(text_file)], trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))


def run_one(tokenizer, text_file, out, workers, fast) -> dict:
    """One prepare() in this (fresh) process: wall time, the CPU time of this process and its workers."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    s = D.prepare(tokenizer, [text_file], out, val_fraction=0.005, workers=workers, progress=False, fast=fast)
    wall = time.perf_counter() - t0
    kids, me2 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    main_cpu = me2.ru_utime + me2.ru_stime - me.ru_utime - me.ru_stime
    cpu = main_cpu + kids.ru_utime + kids.ru_stime
    mb = s["bytes"] / 2**20
    # this process's high-water mark from /proc (ru_maxrss survives the exec from the harness, 10x larger); the
    # workers' from ru_maxrss (forked after the exec)
    hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
    return {"encoder": s["encoder"], "mb": round(mb, 1), "tokens": s["train_tokens"] + s["val_tokens"],
            "wall_s": round(wall, 2), "mb_s": round(mb / wall, 1), "cpu_s": round(cpu, 2),
            "main_cpu_s": round(main_cpu, 2), "mb_per_cpu_s": round(mb / cpu, 1),
            "peak_rss_mb": round(max(kids.ru_maxrss, hwm) / 1024)}


def run(tokenizer, text_file: Path, out: Path, workers: int, fast: bool) -> dict:
    """``run_one`` in a fresh Python process (its own caches, its own memory high-water mark)."""
    args = json.dumps([str(tokenizer), str(text_file), str(out), workers, fast])
    r = subprocess.run([sys.executable, __file__, "--one", args], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def tokens_of(out: Path) -> np.ndarray:
    return np.concatenate([D.read_token_file(out / "train.bin"), D.read_token_file(out / "val.bin")])


def head(src: Path, dst: Path, mb: float):
    """The first ``mb`` MB of ``src`` (cut after a newline)."""
    data = src.read_bytes()[:int(mb * 2**20)]
    dst.write_bytes(data[:data.rfind(b"\n") + 1])


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="size of each input file (MB) for the FastEncoder rows")
    ap.add_argument("--short-mb", type=float, default=8.0,
                    help="size of the file both encoders run on (the first MB of each input), checked equal")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--inputs", default="repeated,mixed,code")
    ap.add_argument("--tokenizers", default="gpt2-512,llama3-32k")
    ap.add_argument("--json", help="write the rows here (benchmarks/results/bench_prepare.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*json.loads(a.one))))
        return
    load0 = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        rows = measure(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()[0]
    print(f"# load average {load0:.1f} at the start, {load1:.1f} at the end ({os.cpu_count()} CPUs)")
    if a.json:
        about = " ".join(__doc__.split("\n\n")[0].split()).rstrip(".")
        doc = {"harness": "benchmarks/bench_prepare.py",
               "about": about + ". mb_s: wall; mb_per_cpu_s: MB over the CPU seconds of the parent and its workers "
                        "(what a busy machine changes least); equal: the tokenizers row's tokens against the "
                        "FastEncoder row's on the same file.",
               "runs": [{"command": "python " + " ".join(sys.argv),
                         "date": datetime.date.today().isoformat(),
                         "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), load average {load0:.1f} at the "
                                    f"start and {load1:.1f} at the end (other processes shared the cores)",
                         "rows": rows}]}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


def measure(a, tmp: Path) -> list[dict]:
    """The inputs and tokenizers written under ``tmp``, then every row (printed as it comes)."""
    files = {}
    for name in a.inputs.split(","):
        files[name] = tmp / f"{name}.txt"
        {"repeated": write_repeated, "mixed": write_mixed, "code": write_code}[name](files[name], a.mb)
        head(files[name], tmp / f"{name}_short.txt", a.short_mb)
    toks = {}
    for name in a.tokenizers.split(","):
        if name == "gpt2-512":
            toks[name] = FIXTURE
        else:
            sample = tmp / "train_sample.txt"
            write_mixed(sample, 8, seed=1)
            t0 = time.perf_counter()
            train_llama3(tmp / name, sample)
            print(f"# trained {name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            toks[name] = tmp / name
    rows = []
    print(f"{'input':9} {'tokenizer':11} {'encoder':12} {'MB':>6} {'tokens':>11} {'wall s':>7} {'MB/s':>6} "
          f"{'CPU s':>6} {'MB/CPU s':>8} {'peak RSS MB':>11}  equal")
    for iname in files:
        for tname, t in toks.items():
            short = tmp / f"{iname}_short.txt"
            for fast, f in ((True, short), (False, short), (True, files[iname])):
                out = tmp / f"out_{iname}_{tname}_{int(fast)}_{f.stem}"
                r = dict(input=iname, tokenizer=tname, **run(t, f, out, a.workers, fast))
                if not fast:
                    r["equal"] = bool(np.array_equal(tokens_of(tmp / f"out_{iname}_{tname}_1_{f.stem}"),
                                                     tokens_of(out)))
                rows.append(r)
                print(f"{iname:9} {tname:11} {r['encoder']:12} {r['mb']:6.1f} {r['tokens']:11,} {r['wall_s']:7.2f} "
                      f"{r['mb_s']:6.1f} {r['cpu_s']:6.2f} {r['mb_per_cpu_s']:8.1f} {r['peak_rss_mb']:11}  "
                      f"{r.get('equal', '')}", flush=True)
    return rows


if __name__ == "__main__":
    main()
