"""Price every pickled kernel log with this checkout's timing and cards; planned / reported."""

import glob
import pickle
import statistics
import sys

from fastpt.plan import gpus, timing

REPORTED = {
    "nanogpt-eager": 250,
    "nanogpt-compiled": 135,
    "llmc-a100": 283,
    "llmc-h100": 141.6,
    "mpt125m-a100": 925,
    "mpt350m-a100": 2230,
    "mpt760m-a100": 3031,
    "mpt1b-a100": 5591,
    "mpt1b-h100": 631,
    "mpt760m-h100": 1773,
    "mpt3b-h100": 5861,
    "mpt7b-h100": 1155,
    "mpt3b-a100-40": 8139,
    "mpt7b-a100-40": 26717,
    "mng-r6-distmuon": 153.84,
    "mng-r7-torch25": 141.82,
    "mng-r5-muon-every-rank": 178.89,
    # torchtitan: tokens per step per GPU (local batch x seq len) / the reported TPS per GPU
    "tt8b-h100-fsdp": 2 * 8192 / 5762 * 1e3,
    "tt8b-h100-fsdp-compile": 2 * 8192 / 6667 * 1e3,
    "tt8b-h100x128-fsdp": 2 * 8192 / 5605 * 1e3,
    "tt8b-h100x128-fsdp-compile": 2 * 8192 / 6514 * 1e3,
    "tt8b-a100x64-fsdp": 8192 / 2904 * 1e3,  # selective layer AC (2,973 with selective op AC)
    "tt8b-a100x64-fsdp-op": 8192 / 2973 * 1e3,  # the same run with selective op AC: the same fastpt flags
    "tt70b-a100x64-fsdp": 8192 / 331 * 1e3,
    "tt-l2-13b-a100x64-none": 2 * 4096 / 2162 * 1e3,
    "tt-l2-13b-a100x64-sel": 2 * 4096 / 1914 * 1e3,  # selective layer AC
    "tt-l2-13b-a100x64-sel-op": 2 * 4096 / 1904 * 1e3,  # selective op AC: the same fastpt flags
    "tt-l2-70b-a100x64-sel": 4096 / 355 * 1e3,  # selective op AC, local batch 1
    "tt-l2-70b-a100x64-full": 2 * 4096 / 353 * 1e3,
}
SAME = {"mng-r6-distmuon": "mng-r7-torch25", "tt8b-a100x64-fsdp": "tt8b-a100x64-fsdp-op"}
SAME["tt-l2-13b-a100x64-sel"] = "tt-l2-13b-a100x64-sel-op"
# the rows of docs/performance.md's band (the runs fastpt can express); the others are planned for reference
BAND = [n for n in REPORTED if n.startswith("mpt") or n in ("mng-r6-distmuon", "mng-r7-torch25")]
BAND += ["tt8b-h100-fsdp", "tt8b-h100-fsdp-compile"]
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.pkl")):
    name, card, log = pickle.load(open(f, "rb"))
    st = timing.step_time(log, gpus.SPEEDS[card])
    rows[name] = st
    if name in SAME:
        rows[SAME[name]] = st
for name, st in rows.items():
    rep = REPORTED.get(name)
    r = f"{st.seconds * 1e3 / rep:.3f}" if rep else "-"
    rep = rep if rep is None else round(rep, 1)
    ms = {k: round(v * 1e3, 1) for k, v in st.parts.items()}
    print(
        f"{name:26s} {st.seconds * 1e3:9.1f} ms  cpu {st.cpu_seconds * 1e3:7.1f}  {st.bound} {ms} rep {rep} ratio {r}"
    )
for label, names in (("band", BAND), ("all", REPORTED)):
    errs = sorted(abs(rows[n].seconds * 1e3 / REPORTED[n] - 1) for n in names if n in rows)
    if errs:
        print(f"{label}: n={len(errs)} median {statistics.median(errs):.3f} worst {errs[-1]:.3f}")
