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
    shape(768, 12, 6, 50304, 1024, 64, 1, f=3072)  # relu2's own width (2048 would mean 3/2 x)
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
# torchtitan (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, commit 820504e2; the same
# tables as docs/performance.md at d4c86e37): Llama 3.1 8B (dim 4096, 32 layers, 32 heads, 8 KV heads,
# FFN 14336, vocab 128256, RoPE theta 500000, untied), seq 8192, local batch 2, FSDP2, bf16, selective AC
# (train_configs/llama3_8b.toml at 9dec370: selective_ac_option 'op'; fastpt's nearest: every other block)
LLAMA3_8B = (
    shape(4096, 32, 32, 128256, 8192, 2, 1, f=14336)
    + " --n-kv-heads 8 --rope-theta 500000 --no-tie-embeddings --parallel fsdp --activation-checkpointing selective"
)
ROWS += [
    ("tt8b-h100-fsdp", "h100-80", 8, LLAMA3_8B),
    ("tt8b-h100-fsdp-compile", "h100-80", 8, LLAMA3_8B + " --compile"),
]
# Apart from the band (planned for reference): the same 8B on 128 H100s (16 hosts, RDMA between them:
# fastpt prices every collective over one host's NVLink), and torchtitan's first published numbers
# (docs/performance.md at 1ea476e9, April 2024: 64 A100 80GB, 8 hosts, eager, local batch 1 x 8192;
# 8B with selective layer AC, 70B with full AC: dim 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672)
LLAMA3_70B = (
    shape(8192, 80, 64, 128256, 8192, 1, 1, f=28672)
    + " --n-kv-heads 8 --rope-theta 500000 --no-tie-embeddings --parallel fsdp --activation-checkpointing full"
)
ROWS += [
    ("tt8b-h100x128-fsdp", "h100-80", 128, LLAMA3_8B),
    ("tt8b-h100x128-fsdp-compile", "h100-80", 128, LLAMA3_8B + " --compile"),
    ("tt8b-a100x64-fsdp", "a100-80", 64, LLAMA3_8B.replace("--micro-batch 2", "--micro-batch 1")),
    ("tt70b-a100x64-fsdp", "a100-80", 64, LLAMA3_70B),
]
# the same page's Llama 2 rows (64 A100 80GB, eager, seq 4096, vocab 32000, RoPE theta 10000): 13B (dim 5120,
# 40 layers, 40 heads, FFN 13824) at local batch 2, 70B (dim 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672)
LLAMA2 = " --no-tie-embeddings --parallel fsdp --activation-checkpointing"
ROWS += [
    ("tt-l2-13b-a100x64-none", "a100-80", 64, shape(5120, 40, 40, 32000, 4096, 2, 1, f=13824) + LLAMA2 + " none"),
    ("tt-l2-13b-a100x64-sel", "a100-80", 64, shape(5120, 40, 40, 32000, 4096, 2, 1, f=13824) + LLAMA2 + " selective"),
    (
        "tt-l2-70b-a100x64-sel",
        "a100-80",
        64,
        shape(8192, 80, 64, 32000, 4096, 1, 1, f=28672) + " --n-kv-heads 8" + LLAMA2 + " selective",
    ),
    (
        "tt-l2-70b-a100x64-full",
        "a100-80",
        64,
        shape(8192, 80, 64, 32000, 4096, 2, 1, f=28672) + " --n-kv-heads 8" + LLAMA2 + " full",
    ),
]
