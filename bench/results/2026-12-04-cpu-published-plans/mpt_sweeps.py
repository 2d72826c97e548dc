"""What MPT's own sequence-length sweeps say about its attention: `python mpt_sweeps.py`.

Source, typed in below: mosaicml/llm-foundry, scripts/train/benchmarking/README.md at commit
b2a43a1477a45f40f4086a1c72f851b0ab42d0ac (2023-10-19, "Update_pretrain_benchmarks (#543)", the commit
that added the H100 80GB BF16 table and re-ran the A100 80GB one; the values below are unchanged in
the file's later versions). Columns used: SeqLen (T), MFU (%), MicroBatchSize, GradAccum, Throughput
(T/s), NumParams; every row has 8 GPUs, amp_bf16, FULL_SHARD and Activation Checkpointing False (the
rows with checkpointing are left out: MFU does not count the recompute).

The table's MFU (its "MFU and HFU" section) is (6 N + 12 L d T) x tokens/s / (GPUs x peak), with
attention counted non-causal. MPT's attention is causal, so it does 6 L d T of the model's FLOPs per
token (half). For one model over its sweep of T, the time per token x peak is then

    6 N / r_rest + 6 L d T / r_attn

with r_rest the share of peak everything but attention reached and r_attn attention's (on its model
FLOPs: 3 x the causal forward). Least squares over the sweep gives both. Nothing here goes into
fastpt's constants; fastpt's own rate is read from fastpt.plan for comparison.
"""

import numpy as np

from fastpt.plan.flops import BACKWARD_ATTENTION
from fastpt.plan.gpus import SPEEDS
from fastpt.plan.timing import ATTENTION_SHARE

PEAK = {"h100": 989e12, "a100": 312e12}  # the table's GPU_AVAILABLE_FLOPS (bf16 dense), see check below
V = 50368  # vocab_size of every MPT yaml
# scripts/train/yamls/pretrain/mpt-<size>.yaml at b2a43a14: d_model, n_layers (attn_impl: triton, no
# alibi in the yaml and attn_config's default alibi False: learned position embeddings, which is why
# NumParams grows by d_model per token of max_seq_len)
YAML = {"350m": (1024, 24), "760m": (1536, 24), "1b": (2048, 24), "3b": (2560, 32)}
# (card, size): [(T, MFU %, micro, accum, T/s, NumParams)]; 8 GPUs, no activation checkpointing
SWEEPS = {
    ("h100", "760m"): [
        (512, 40.42, 96, 2, 669998, 758111232),
        (1024, 39.76, 48, 2, 628648, 758897664),
        (2048, 34.90, 24, 2, 505177, 760470528),
        (4096, 35.83, 12, 2, 443674, 763616256),
        (8192, 34.84, 6, 2, 334602, 769907712),
        (16384, 33.57, 3, 2, 222521, 782490624),
        (32768, 31.84, 1, 2, 130333, 807656448),
    ],
    ("h100", "1b"): [
        (512, 43.21, 56, 4, 418201, 1312804864),
        (1024, 41.95, 18, 4, 391287, 1313853440),
        (2048, 41.82, 14, 1, 363645, 1315950592),
        (4096, 40.26, 7, 4, 308282, 1320144896),
        (8192, 37.73, 3, 4, 233256, 1328533504),
        (16384, 35.22, 2, 4, 157194, 1345310720),
        (32768, 33.54, 1, 4, 96203, 1378865152),
    ],
    ("h100", "3b"): [
        (512, 46.32, 40, 6, 223721, 2647905280),
        (1024, 46.20, 20, 6, 216369, 2649216000),
        (4096, 42.31, 5, 6, 167712, 2657080320),
        (8192, 40.31, 3, 6, 132626, 2667566080),
        (16384, 36.34, 1, 6, 89223, 2688537600),
    ],
    ("a100", "350m"): [
        (512, 50.61, 128, 2, 554643, 354412544),
        (1024, 50.51, 64, 2, 518504, 354936832),
        (2048, 51.62, 32, 2, 470263, 355985408),
        (4096, 53.31, 16, 2, 396442, 358082560),
        (8192, 53.80, 8, 2, 292559, 362276864),
        (16384, 53.28, 4, 2, 188478, 370665472),
        (32768, 52.46, 2, 2, 109222, 387442688),
        (65536, 52.70, 1, 2, 60195, 420997120),
    ],
    ("a100", "760m"): [
        (512, 45.07, 96, 2, 235571, 758111232),
        (1024, 47.76, 48, 2, 238122, 758897664),
        (2048, 56.85, 24, 2, 259472, 760470528),
        (4096, 56.05, 12, 2, 218808, 763616256),
        (8192, 55.31, 6, 2, 167471, 769907712),
        (16384, 54.64, 3, 2, 114198, 782490624),
        (32768, 54.57, 1, 2, 70417, 807656448),
    ],
    ("a100", "1b"): [
        (512, 60.68, 56, 4, 185186, 1312804864),
        (1024, 60.15, 18, 4, 176898, 1313853440),
        (2048, 59.86, 14, 4, 164109, 1315950592),
        (4096, 59.00, 7, 4, 142457, 1320144896),
        (8192, 56.69, 3, 4, 110516, 1328533504),
        (16384, 56.60, 2, 4, 79650, 1345310720),
        (32768, 55.52, 1, 4, 50207, 1378865152),
    ],
}
# The draft's selection (each sweep without the rows it left out): the H100 T = 2048 rows, and the
# A100 760M's T = 512 and 1024 and 350M's T = 512, which sit below the rest of their sweep.
LEFT_OUT = {("h100", "760m"): {2048}, ("h100", "1b"): {2048}, ("a100", "760m"): {512, 1024}, ("a100", "350m"): {512}}
# fastpt's table rows of these sizes (docs/performance.md, "Published runs"; priced.txt):
# (size, T, reported ms, planned ms)
BAND = {
    "h100": [("1b", 2048, 631, 509.5), ("760m", 4096, 1773, 1265.8), ("3b", 4096, 5861, 4797.9)],
    "a100": [("350m", 2048, 2230, 2007.6), ("760m", 2048, 3031, 2888.4), ("1b", 2048, 5591, 5550.3)],
}


def check(card, size, rows):
    """The table against itself: d from NumParams' growth with T, L from the count, MFU from T/s."""
    d, layers = YAML[size]
    (t0, *_, n0), (t1, *_, n1) = rows[0], rows[-1]
    d_from_n = (n1 - n0) / (t1 - t0)
    # per block: 12 d^2 weights + 13 d biases and LayerNorm parameters; plus wte (V d), wpe (T d), final norm (2 d)
    l_from_n = (n0 - V * d - t0 * d - 2 * d) / (12 * d * d + 13 * d)
    mfus = [(6 * n + 12 * layers * d * t) * tps / (8 * PEAK[card]) * 100 - mfu for t, mfu, _, _, tps, n in rows]
    worst = max(abs(m) for m in mfus)
    return d_from_n, l_from_n, worst


def fit(card, size, rows):
    d, layers = YAML[size]
    a = np.array([[6.0 * n, 6.0 * layers * d * t] for t, _, _, _, _, n in rows])
    y = np.array([(6.0 * n + 12.0 * layers * d * t) / (mfu / 100) for t, mfu, _, _, _, n in rows])
    inv, *_ = np.linalg.lstsq(a, y, rcond=None)
    return 1 / inv[0], 1 / inv[1], float(np.max(np.abs(a @ inv / y - 1)))


def fastpt_rate(card):
    """fastpt's attention rate on the same basis (model FLOPs: 3 x the causal forward, per unit time)."""
    share = SPEEDS["h100-80" if card == "h100" else "a100-80"].matmul_eff
    fwd, bwd = ATTENTION_SHARE[False], ATTENTION_SHARE[True]
    time = 1 / fwd + BACKWARD_ATTENTION / bwd  # per forward FLOP, in units of 1 / (peak x share)
    return share * 3 / time, share * (1 + BACKWARD_ATTENTION) / time


print("Check of the typed-in table (8 GPUs, no AC): d and L from NumParams, MFU recomputed from T/s")
for (card, size), rows in SWEEPS.items():
    d_n, l_n, worst = check(card, size, rows)
    d, layers = YAML[size]
    print(f"  {card} {size:5s} yaml d {d} L {layers}: from NumParams d {d_n:.0f} L {l_n:.2f};", end=" ")
    print(f"MFU recomputed within {worst:.2f} points")
print()
print("Fits (share of the card's bf16 peak; attention on its causal model FLOPs):")
fits = {}
for (card, size), rows in SWEEPS.items():
    kept = [r for r in rows if r[0] not in LEFT_OUT.get((card, size), ())]
    for label, sel in (("all rows", rows), ("draft's rows", kept)):
        rest, attn, err = fit(card, size, sel)
        if label == "draft's rows":
            fits[card, size] = (rest, attn)
        print(f"  {card} {size:5s} {label:12s} n={len(sel)}: rest {rest:.3f}, attention {attn:.3f},", end=" ")
        print(f"worst misfit {err:.1%}")
print()
for card in ("h100", "a100"):
    model, executed = fastpt_rate(card)
    fwd, bwd = ATTENTION_SHARE[False], ATTENTION_SHARE[True]
    print(f"fastpt's attention, {card}: {model:.3f} of peak on model FLOPs ({executed:.3f} on the FLOPs its", end=" ")
    print(f"kernels do, backward {BACKWARD_ATTENTION} x the forward; ATTENTION_SHARE {fwd} / {bwd} x matmul share)")
print()
print("fastpt's table rows of these sizes: each reported step split by its sweep's fit (the draft's rows),")
print("and the step with MPT's attention at fastpt's planned rate (everything else as measured):")
for card, rows in BAND.items():
    model, _ = fastpt_rate(card)
    for size, t, reported, planned in rows:
        d, layers = YAML[size]
        n = next(r[5] for r in SWEEPS[card, size] if r[0] == t)
        rest, attn = fits[card, size]
        t_rest, t_attn = 6 * n / rest, 6 * layers * d * t / attn
        share = t_attn / (t_rest + t_attn)
        swapped = reported * (t_rest + 6 * layers * d * t / model) / (t_rest + t_attn)
        print(
            f"  {card} {size:5s} T={t:5d}: attention {share:.0%} of the measured step; reported {reported} ms,"
            f" with fastpt's attention {swapped:.0f} ms; planned {planned} ms: planned / reported"
            f" {planned / reported:.3f} -> {planned / swapped:.3f}"
        )
