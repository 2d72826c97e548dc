"""The published runs: (name, card, world, flags). Shapes as docs/performance.md says."""


def shape(d, layers, h, v, t, b, a, f=None):
    f = f or -(-(8 * d // 3) // 64) * 64  # 8D/3 rounded up to a multiple of 64
    return (
        f"--preset 0.1b --dim {d} --n-layers {layers} --n-heads {h} --ffn-dim {f} --vocab-size {v}"
        f" --seq-len {t} --max-seq-len {t} --micro-batch {b} --grad-accum {a}"
    )


GPT2 = lambda b, a=1: shape(768, 12, 12, 50304, 1024, b, a)
MPT = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
}


def mpt(size, t, b, a):
    d, layers, h = MPT[size]
    return shape(d, layers, h, 50368, t, b, a) + " --compile --parallel fsdp"


ROWS = [
    ("nanogpt-eager", "a100-40", 1, GPT2(12) + " --kernels torch"),
    ("nanogpt-compiled", "a100-40", 1, GPT2(12) + " --kernels torch --compile"),
    ("llmc-a100", "a100-80", 8, GPT2(64) + " --kernels torch --compile --parallel ddp"),
    ("llmc-h100", "h100-80", 8, GPT2(64) + " --kernels torch --compile --parallel ddp"),
    ("mpt125m-a100", "a100-80", 8, mpt("125m", 2048, 32, 2)),
    ("mpt350m-a100", "a100-80", 8, mpt("350m", 2048, 32, 2)),
    ("mpt760m-a100", "a100-80", 8, mpt("760m", 2048, 24, 2)),
    ("mpt1b-a100", "a100-80", 8, mpt("1b", 2048, 14, 4)),
    ("mpt1b-h100", "h100-80", 8, mpt("1b", 2048, 14, 1)),
    ("mpt760m-h100", "h100-80", 8, mpt("760m", 4096, 12, 2)),
    ("mpt3b-h100", "h100-80", 8, mpt("3b", 4096, 5, 6)),
    ("mpt7b-h100", "h100-80", 8, mpt("7b", 2048, 6, 1)),
    ("mpt3b-a100-40", "a100-40", 8, mpt("3b", 2048, 5, 8)),
    ("mpt7b-a100-40", "a100-40", 8, mpt("7b", 2048, 12, 4) + " --activation-checkpointing full"),
]
# modded-nanogpt records (KellerJordan/modded-nanogpt, records/track_1_short/*/ logs): 8 x H100, 64 x 1024,
# compiled, dim 768, 12 layers, 6 heads, ReLU^2 MLP 3072, QK-norm, tied, vocab 50304, Muon on the blocks
MNG = (
    shape(768, 12, 6, 50304, 1024, 64, 1, f=2048)
    + " --mlp relu2 --qk-norm --tie-embeddings --kernels torch --compile --optimizer muon --parallel ddp"
)
ROWS += [
    ("mng-r6-distmuon", "h100-80", 8, MNG),
    ("mng-r5-muon-every-rank", "h100-80", 1, MNG),
    ("mng-adamw-same-shape", "h100-80", 8, MNG.replace("--optimizer muon", "--optimizer adamw")),
]
H200 = "--preset 0.04b --kernels torch --dtype bf16 --seq-len 1024"
ROWS += [
    ("h200-eager-16x4", "h200", 1, H200 + " --micro-batch 16 --grad-accum 4"),
    ("h200-compiled-16x4", "h200", 1, H200 + " --compile --micro-batch 16 --grad-accum 4"),
    ("h200-compiled-32x2", "h200", 1, H200 + " --compile --micro-batch 32 --grad-accum 2"),
    ("h200-compiled-64x1", "h200", 1, H200 + " --compile --micro-batch 64 --grad-accum 1"),
]
ROWS += [("p004-eager", "h100-80", 1, "--preset 0.04b"), ("p004-compiled", "h100-80", 1, "--preset 0.04b --compile")]
