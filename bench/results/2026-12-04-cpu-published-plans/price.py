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
}
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.pkl")):
    name, card, log = pickle.load(open(f, "rb"))
    st = timing.step_time(log, gpus.SPEEDS[card])
    rows[name] = st
    if name == "mng-r6-distmuon":
        rows["mng-r7-torch25"] = st
for name, st in rows.items():
    rep = REPORTED.get(name)
    r = f"{st.seconds * 1e3 / rep:.3f}" if rep else "-"
    ms = {k: round(v * 1e3, 1) for k, v in st.parts.items()}
    print(
        f"{name:26s} {st.seconds * 1e3:9.1f} ms  cpu {st.cpu_seconds * 1e3:7.1f}  {st.bound} {ms} rep {rep} ratio {r}"
    )
errs = sorted(abs(rows[n].seconds * 1e3 / REPORTED[n] - 1) for n in REPORTED if n in rows)
if errs:
    print(f"n={len(errs)} median {statistics.median(errs):.3f} worst {errs[-1]:.3f}")
