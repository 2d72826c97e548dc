"""python -m bench prepare: fastpt.prepare's MB/s, tokens/s and peak memory on a >= 1 GB corpus,
next to the raw speed of the same tokenizer's encode_batch on the same text, in the same run.

The corpus is real text: the Python standard library's sources as JSONL documents (one
`{"text": ...}` per line, the shape of a web corpus), repeated in a new shuffled order each time
until it holds --size-gb of text. fastpt.prepare runs as the user runs it, a separate process
whose memory (the sum over it and its workers) is sampled while it runs; the raw figure is
`encode_batch` in this process on the same ~1 MB batches, with the tokenizer's own threads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, git_commit, markdown_table
from fastpt.data.sources import documents, find_sources
from fastpt.data.tokenizer import load_tokenizer
from fastpt.hf import write_json
from fastpt.prepare import TOKENIZER_SAMPLE_MB, batches, stdlib_sources

FILE_BYTES = 128 * 2**20  # corpus files of about this much text


def make_corpus(folder: Path, size_gb: float) -> int:
    """JSONL files of shuffled stdlib documents holding size_gb of text; returns the text bytes.
    Reused when a previous run left one of the same size (the marker file says so)."""
    marker = folder.with_suffix(".json")  # beside the corpus, not read as a part of it
    if marker.is_file() and json.loads(marker.read_text())["size_gb"] == size_gb:
        return json.loads(marker.read_text())["text_bytes"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources()]
    rng = random.Random(0)
    total = in_file = 0
    f = None
    while total < size_gb * 2**30:
        for doc in rng.sample(docs, len(docs)):
            if f is None or in_file >= FILE_BYTES:
                f = open(folder / f"part-{total // FILE_BYTES:05d}.jsonl", "w", encoding="utf-8")
                in_file = 0
            f.write(json.dumps({"text": doc}) + "\n")
            n = len(doc.encode())
            total, in_file = total + n, in_file + n
    f.close()
    marker.write_text(json.dumps({"size_gb": size_gb, "text_bytes": total}))
    return total


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def run_prepare(corpus: Path, out: Path, tokenizer: str, workers: int, vocab_size: int) -> dict:
    """fastpt.prepare as a user runs it; its meta.json plus wall time and sampled peak memory."""
    cmd = [
        sys.executable,
        "-m",
        "fastpt.prepare",
        str(corpus),
        "--out",
        str(out),
        "--overwrite",
        "--tokenizer",
        tokenizer,
        "--workers",
        str(workers),
        "--vocab-size",
        str(vocab_size),
    ]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.25)
    if proc.returncode:
        raise RuntimeError(f"fastpt.prepare failed with exit code {proc.returncode}")
    meta = json.loads((out / "meta.json").read_text())
    return {**meta, "wall_s": time.perf_counter() - t0, "peak_rss_gib": peak / 2**30}


def raw_encode(corpus: Path, tokenizer_json: Path) -> dict:
    """encode_batch alone over the same text in the same batches: only the encode calls are timed."""
    tok = load_tokenizer(tokenizer_json)
    seconds, nbytes, tokens = 0.0, 0, 0
    for batch in batches(documents(find_sources([corpus]))):
        texts = [text for text, _ in batch]
        t0 = time.perf_counter()
        tokens += sum(map(len, tok.encode_batch(texts)))
        seconds += time.perf_counter() - t0
        nbytes += sum(len(t.encode()) for t in texts)
    return {"seconds": seconds, "text_bytes": nbytes, "tokens": tokens}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="text in the corpus (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=2, help="fastpt.prepare --workers (default: %(default)s)")
    ap.add_argument("--tokenizer", default="bpe", help="fastpt.prepare --tokenizer (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=32000, help="BPE vocab (default: %(default)s)")
    ap.add_argument("--dir", default="/tmp/fastpt-bench-prepare", help="corpus and output (default: %(default)s)")
    ap.add_argument("--save", default="", help="folder for prepare.json / prepare.md (default: print only)")
    args = ap.parse_args(argv)

    work = Path(args.dir)
    print(f"corpus: {args.size_gb} GB of shuffled stdlib documents as JSONL in {work / 'corpus'}", flush=True)
    text_bytes = make_corpus(work / "corpus", args.size_gb)
    load_before = load()
    prep = run_prepare(work / "corpus", work / "data", args.tokenizer, args.workers, args.vocab_size)
    load_between = load()
    raw = raw_encode(work / "corpus", work / "data" / "tokenizer.json")
    tokens = prep["tokens"]["train"] + prep["tokens"]["val"]
    mb = text_bytes / 2**20
    tok_s = prep["seconds"]["tokenize"]
    rows = {
        "raw encode_batch": {
            "mb_s": raw["text_bytes"] / 2**20 / raw["seconds"],
            "tok_s": raw["tokens"] / raw["seconds"],
            "seconds": raw["seconds"],
        },
        f"fastpt.prepare --workers {args.workers} (tokenizing)": {
            "mb_s": mb / tok_s,
            "tok_s": tokens / tok_s,
            "seconds": tok_s,
        },
        f"fastpt.prepare --workers {args.workers} (end to end)": {
            "mb_s": mb / prep["wall_s"],
            "tok_s": tokens / prep["wall_s"],
            "seconds": prep["wall_s"],
        },
    }
    for row in rows.values():
        row["vs_raw"] = row["mb_s"] / rows["raw encode_batch"]["mb_s"]
    result = {
        "corpus_gb": text_bytes / 2**30,
        "documents": prep["documents"],
        "tokens": tokens,
        "tokenizer": args.tokenizer,
        "vocab_size": prep["vocab_size"],
        "workers": args.workers,
        "tokenizer_build_s": prep["seconds"]["tokenizer"],
        "peak_rss_gib": prep["peak_rss_gib"],
        "rows": rows,
        "cpus": os.cpu_count(),
        "loadavg": {"before": load_before, "between": load_between, "after": load()},
        "python": platform.python_version(),
        "tokenizers": __import__("tokenizers").__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    table = markdown_table(
        ["", "MB/s", "tokens/s", "seconds", "vs raw", "peak RSS (GiB, all processes)"],
        [
            [
                name,
                f"{r['mb_s']:.2f}",
                f"{r['tok_s']:,.0f}",
                f"{r['seconds']:.0f}",
                f"{r['vs_raw']:.2f}x",
                f"{prep['peak_rss_gib']:.2f}" if "prepare" in name else "–",
            ]
            for name, r in rows.items()
        ],
    )
    summary = (
        f"{text_bytes / 2**30:.2f} GiB of text, {prep['documents']:,} documents, {tokens:,} tokens; "
        f"tokenizer {args.tokenizer} (vocab {prep['vocab_size']}, built in "
        f"{prep['seconds']['tokenizer']:.0f} s from the first {TOKENIZER_SAMPLE_MB} MB); "
        f"{os.cpu_count()} CPUs, load average {load_before} / {load()}; commit {result['commit']}"
    )
    print(f"\n{table}\n\n{summary}")
    if args.save:
        write_json(Path(args.save) / "prepare.json", result)
        Path(args.save, "prepare.md").write_text(f"# fastpt.prepare on this machine\n\n{table}\n\n{summary}\n")
    return 0
