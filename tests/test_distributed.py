"""torchrun with real processes (gloo on CPU): DDP and FSDP follow a one-process run step for step,
checkpoints move between world sizes and layouts, Muon splits its matrices over the ranks bit for bit,
and a rank that dies is named and restarted from.

Every two-process run that is compared with a one-process run trains in one torchrun launch
(tests/torchrun_cases.py: one case per run, each checked by its own test); the one-process runs train
in this process. The launches of their own: a rank killed, preempted or stopped (torchrun restarts
the group), and Muon's optimizer alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, failure_of, made_once, run_quietly
from fastpt import checkpoint, train
from torchrun_cases import launch

pytestmark = pytest.mark.slow

# Global batch 8 windows per step: 1 process x 4 x accum 2, or 2 processes x 2 x accum 2, so the
# two-process runs also exercise the no-sync micro-steps. Eval and checkpoints land at step 3.
COMMON = (
    *TINY,
    "--max-steps",
    "6",
    "--warmup-steps",
    "1",
    "--lr",
    "3e-3",
    "--log-every",
    "1",
    "--eval-every",
    "3",
    "--eval-tokens",
    "512",
    "--ckpt-every",
    "3",
)
ONE_PROC = ("--micro-batch", "4", "--grad-accum", "2")
TWO_PROCS = ("--micro-batch", "2", "--grad-accum", "2")
FSDP = ("--parallel", "fsdp")
MUON_RUN = ("--optimizer", "muon", "--muon-momentum-warmup", "2", "--schedule", "wsd")
# Squared-ReLU MLP, soft-capped logits, U-net skips (a root parameter FSDP shards with the embedding)
# and the batch warm-up (fewer no-sync micro-steps at first).
OPTIONS = ("--mlp", "relu2", "--logit-softcap", "15", "--unet-skips", "--batch-warmup-steps", "2")
MUON_DOCUMENTS = ("--optimizer", "muon", "--attention", "document", "--schedule", "wsd")
# Every nanochat ingredient at once (fastpt.recipes): Polar Express, NorMuon (its running mean square
# kept whole on every rank), cautious decay on its schedule, the momentum schedule, nanochat's AdamW
# groups; value embeddings, layer scalars and the backout (root parameters FSDP shards with the
# embedding), parameter-free norms.
NANOCHAT = ("--recipe", "nanochat", "--muon-momentum-warmup", "2", "--muon-weight-decay", "0.5")

ONE_PROCESS_RUNS = {  # name -> flags
    "one": (),
    "muon-one": MUON_RUN,
    "options-one": OPTIONS,
    "documents-one": ("--attention", "document"),
    "muon-documents-one": MUON_DOCUMENTS,
    "nanochat-one": NANOCHAT,
}
TWO_PROCESS_RUNS = {  # name -> flags, in launch order
    "ddp": (),
    "fsdp": FSDP,
    "fsdp-reshard": (*FSDP, "--fsdp-reshard-grads"),
    "one-resumed-sharded": (*FSDP, "--resume"),
    "muon-ddp": MUON_RUN,
    "muon-fsdp": (*MUON_RUN, *FSDP),
    "muon-one-resumed-sharded": (*MUON_RUN, *FSDP, "--resume"),
    "options-ddp": (*OPTIONS, "--parallel", "ddp"),
    "options-fsdp": (*OPTIONS, *FSDP),
    "copying-ddp": (),  # under torchrun_cases.PATCHES's "copying-ddp"
    "documents-fsdp": ("--attention", "document", *FSDP),
    "muon-documents-ddp": MUON_DOCUMENTS,
    "compiled-fsdp-selective": (*FSDP, "--compile", "--activation-checkpointing", "selective"),
    "compiled-ddp-full": ("--parallel", "ddp", "--compile", "--activation-checkpointing", "full"),
    "compiled-ddp-selective": ("--parallel", "ddp", "--compile", "--activation-checkpointing", "selective"),
    "nanochat-ddp": (*NANOCHAT, "--parallel", "ddp"),
    "nanochat-fsdp": (*NANOCHAT, *FSDP),
}
RESUMED = {"one-resumed-sharded": "one", "muon-one-resumed-sharded": "muon-one"}  # from that run's step 3


def curve(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, 'loss' | 'val_loss') -> value, from metrics.jsonl."""
    out = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key in ("loss", "val_loss"):
            if key in record:
                assert (record["step"], key) not in out, "metrics written twice: more than one rank logs"
                out[record["step"], key] = record[key]
    return out


def assert_same_curve(run_dir: Path, reference: Path, from_step: int = 0) -> None:
    got, want = curve(run_dir), {k: v for k, v in curve(reference).items() if k[0] > from_step}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-3 * abs(v), (k, got[k], v)


def resume_from(run_dir: Path, checkpoint: str, out: Path) -> Path:
    """A fresh run folder holding only run_dir's checkpoint at step 3 (the run went on to step 6)."""
    out.mkdir(parents=True)
    src = run_dir / checkpoint
    (shutil.copytree if src.is_dir() else shutil.copy)(src, out / checkpoint)
    return out


def train_here(data: Path, out: Path, *extra: str) -> Path:
    """A one-process run, in this process."""
    code, _, err = run_quietly(train.main, [*COMMON, "--data", str(data), "--out", str(out), *ONE_PROC, *extra])
    assert code == 0, err
    return out


def train_all(data: Path, root: Path) -> None:
    """Every run of ONE_PROCESS_RUNS here, then every run of TWO_PROCESS_RUNS in one torchrun launch."""
    for name, flags in ONE_PROCESS_RUNS.items():
        train_here(data, root / name, *flags)
    for name, source in RESUMED.items():
        resume_from(root / source, "ckpt_00000003.pt", root / name)
    cases = {
        name: [*COMMON, "--data", str(data), "--out", str(root / name), *TWO_PROCS, *flags]
        for name, flags in TWO_PROCESS_RUNS.items()
    }
    results = launch(cases, root / "cases", patches={"copying-ddp": "copying-ddp"})
    (root / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> Path:
    """The folder of every run in ONE_PROCESS_RUNS and TWO_PROCESS_RUNS, one run folder each by name
    (trained once for all of pytest-xdist's workers). A two-process run's comes through `ran`."""
    return made_once(tmp_path_factory, "distributed-runs", lambda root: train_all(tiny_data, root))


def ran(runs: Path, name: str) -> Path:
    """The run folder of a two-process case that exited 0 (else its exit code and output)."""
    result = json.loads((runs / "results.json").read_text())[name]
    assert result["code"] == 0, f"{name}: exit {result['code']}\n{result['stdout'][-2000:]}\n{result['stderr']}"
    return runs / name


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_two_processes_follow_one_process(runs, layout):
    assert_same_curve(ran(runs, layout), runs / "one")


def test_fsdp_reducing_every_micro_step_follows_one_process(runs):
    """--fsdp-reshard-grads: FSDP reduce-scatters at every micro-step (no unsharded gradients kept
    across them) and trains as the one-process run does."""
    assert_same_curve(ran(runs, "fsdp-reshard"), runs / "one")


@pytest.mark.parametrize("layout, checkpointing", [("fsdp", "selective"), ("ddp", "full"), ("ddp", "selective")])
def test_compiled_with_activation_checkpointing_follows_one_process(runs, layout, checkpointing):
    """FSDP compiles each block before sharding it, DDP the whole model before wrapping it; with
    activation checkpointing inside the blocks both still train as the eager one-process run."""
    out = ran(runs, f"compiled-{layout}-{checkpointing}")
    assert_same_curve(out, runs / "one")
    assert {
        r["recompiles"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    } == {0}


def test_checkpoint_kinds(runs):
    assert (ran(runs, "ddp") / "ckpt_00000006.pt").is_file()  # one copy, from rank 0
    assert (ran(runs, "fsdp") / "ckpt_00000006").is_dir()  # DCP shards from every rank
    assert (runs / "fsdp" / "latest").read_text() == "ckpt_00000006"


@pytest.mark.parametrize("layout, checkpoint", [("ddp", "ckpt_00000003.pt"), ("fsdp", "ckpt_00000003")])
def test_two_process_checkpoint_resumes_in_one_process(runs, tiny_data, tmp_path, layout, checkpoint):
    out = train_here(tiny_data, resume_from(ran(runs, layout), checkpoint, tmp_path / "resumed"), "--resume")
    assert_same_curve(out, runs / "one", from_step=3)


def test_one_process_checkpoint_resumes_sharded_in_two(runs):
    """The launch resumed a fresh folder holding only the one-process run's checkpoint of step 3 (RESUMED)."""
    assert_same_curve(ran(runs, "one-resumed-sharded"), runs / "one", from_step=3)


# ---- Muon over ranks: whole matrices split between them, under DDP and FSDP2

MUON_STEPS = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from fastpt.muon import Muon
layouts, out, rank = sys.argv[1].split(","), sys.argv[2], os.environ.get("RANK", "0")
for layout in layouts:  # "one" first: Muon splits its matrices over the ranks once a process group exists
    if layout != "one" and not dist.is_initialized():
        dist.init_process_group("gloo")
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if layout == "fsdp" else (lambda t: t)
    torch.manual_seed(0)  # three (48, 16): one rank orthogonalizes two of them, the other one; 33 rows shard unevenly
    shapes = [(48, 16), (16, 48), (48, 16), (33, 20), (48, 16)]
    params = [torch.nn.Parameter(place(torch.randn(*s))) for s in shapes]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = place(torch.randn(p.shape, generator=g))
        opt.step()
    whole = lambda t: t.full_tensor() if layout == "fsdp" else t.detach()
    state = [whole(opt.state[p]["momentum_buffer"]) for p in params]
    torch.save(([whole(p) for p in params], state), f"{out}/{layout}.{rank}")
"""


def test_muon_steps_bit_identically_over_two_ranks_under_ddp_and_fsdp(tmp_path):
    """The same gradients give every rank, under either layout, exactly the one process's weights and
    momentum: the split by whole matrices changes who computes, not what. (One launch: each rank steps
    alone first, then under DDP, then under FSDP.)"""
    script = tmp_path / "muon_steps.py"
    script.write_text(MUON_STEPS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*torchrun, str(script), "one,ddp,fsdp", str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 0, failure_of(proc)
    want = torch.load(tmp_path / "one.0")
    for name in ("one.1", "ddp.0", "ddp.1", "fsdp.0", "fsdp.1"):
        got = torch.load(tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True)), name
    assert not torch.equal(want[0][0], torch.load(tmp_path / "ddp.0")[0][2])  # the matrices do differ


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_muon_over_two_processes_follows_one_process(runs, layout):
    assert_same_curve(ran(runs, f"muon-{layout}"), runs / "muon-one")


def test_muon_resumes_across_layouts(runs, tiny_data, tmp_path):
    """An FSDP checkpoint (DCP shards of the momentum) resumes in one process, a one-process one under
    FSDP, and both go on as the uninterrupted run."""
    fsdp = resume_from(ran(runs, "muon-fsdp"), "ckpt_00000003", tmp_path / "one")
    assert_same_curve(train_here(tiny_data, fsdp, *MUON_RUN, "--resume"), runs / "muon-one", from_step=3)
    assert_same_curve(ran(runs, "muon-one-resumed-sharded"), runs / "muon-one", from_step=3)


def test_muon_with_document_attention_under_ddp_follows_one_process(runs):
    assert_same_curve(ran(runs, "muon-documents-ddp"), runs / "muon-documents-one")


def test_document_attention_under_fsdp_follows_one_process(runs):
    assert_same_curve(ran(runs, "documents-fsdp"), runs / "documents-one")


# ---- a rank that dies under torchrun

DIST_FAULT = r"""
import os, signal, sys, time
if os.environ["RANK"] == "0" and os.environ.get("FAULT_LOG"):  # when each attempt's rank 0 began
    with open(os.path.join(os.environ["FAULT_LOG"], "attempt" + os.environ["TORCHELASTIC_RESTART_COUNT"]), "w") as f:
        f.write(repr(time.time()))
import torch.distributed.checkpoint as dcp
from fastpt import errors, model, train
fault, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
victim = os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
real_forward, real_save = model.Transformer.forward, dcp.save
accum = int(argv[argv.index("--grad-accum") + 1])
forwards = 0

def forward(self, idx, *args, **kwargs):
    global forwards
    if self.training and victim:
        forwards += 1
        if fault == "kill-at-step" and (forwards - 1) // accum + 1 == at:  # mid-step, before its update
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "term-at-step" and forwards == accum * at:  # as a scheduler preempting this rank
            os.kill(os.getpid(), signal.SIGTERM)
        if fault == "stop-at-step" and (forwards - 1) // accum + 1 == at:  # hangs: alive, never answering
            with open(os.path.join(os.environ["FAULT_LOG"], "stopped"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
    return real_forward(self, idx, *args, **kwargs)

def save(state, *, checkpoint_id):
    if fault == "kill-in-dcp-save" and victim and checkpoint_id.name == f".ckpt_{at:08d}.partial":
        checkpoint_id.mkdir(parents=True, exist_ok=True)
        (checkpoint_id / "__1_0.distcp").write_bytes(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(state, checkpoint_id=checkpoint_id)

model.Transformer.forward, dcp.save = forward, save
errors.run_command(lambda: train.main(argv))
"""


@pytest.mark.parametrize(
    "layout, fault, at",
    [("ddp", "kill-at-step", 5), ("fsdp", "kill-in-dcp-save", 6)],
    ids=["ddp-rank-killed-mid-step", "fsdp-rank-killed-writing-a-checkpoint"],
)
def test_a_rank_killed_under_torchrun_is_named_and_the_restart_resumes_exactly(
    runs, tiny_data, tmp_path, layout, fault, at
):
    """torchrun --max-restarts 1, rank 1 SIGKILLed (in step 5, or while writing the sharded checkpoint of
    step 6): the survivor stops within the collective timeout with one line naming rank 1, the restarted
    group resumes from the newest complete checkpoint (step 3: a half-written one is never taken), and
    every logged loss equals the uninterrupted two-process run's exactly."""
    script = tmp_path / "faulty.py"
    script.write_text(DIST_FAULT)
    out = tmp_path / "run"
    args = [*COMMON, "--data", str(tiny_data), "--out", str(out), *TWO_PROCS, "--parallel", layout, "--resume"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        str(script),
        fault,
        str(at),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTPT_COLLECTIVE_TIMEOUT": "60"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, failure_of(result)
    if fault == "kill-at-step":  # the survivor's collective fails: one line naming the dead rank
        said = [line for line in result.stderr.splitlines() if line.startswith("fastpt: error: rank 0: rank 1 (pid")]
        assert len(said) == 1 and " died; a collective failed" in said[0], result.stderr[-4000:]
    else:  # the survivor's half of the checkpoint fails: the previous one stands
        said = [
            line
            for line in result.stderr.splitlines()
            if line.startswith(f"fastpt: warning: could not write checkpoint {out / 'ckpt_00000006'}: ")
        ]
        assert len(said) == 1 and said[0].endswith("; ckpt_00000003 is intact"), result.stderr[-4000:]
    assert "Traceback" not in result.stderr.split(said[0])[0]  # the first attempt ended without one
    assert result.stdout.count("resumed from") == 1
    assert f"resumed from {out / checkpoint_name(layout, 3)}" in result.stdout
    assert curve(out) == curve(ran(runs, layout))  # exactly, step for step
    assert not list(out.glob(".ckpt_*"))  # the half-written checkpoint was cleared by the next save


def restarted_ddp_run(
    tmp_path: Path, fault: str, at: int, args: list[str], env: dict | None = None
) -> subprocess.CompletedProcess:
    """DIST_FAULT's `fault` at step `at` of a two-process DDP run under torchrun --max-restarts 1
    with --resume, which must end well (exit 0) after the restart."""
    script = tmp_path / "faulty.py"
    script.write_text(DIST_FAULT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    result = subprocess.run(
        [*torchrun, str(script), fault, str(at), *args, *TWO_PROCS, "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=REPO,
    )
    assert result.returncode == 0, failure_of(result)
    return result


def test_a_rank_preempted_under_torchrun_exits_143_and_the_restart_resumes_exactly(runs, tiny_data, tmp_path):
    """torchrun --max-restarts 1, rank 1 SIGTERMed in step 4 (DDP): the ranks agree on it at that log
    step, checkpoint step 4 and exit 143, which torchrun takes for a failure and restarts the group;
    the restart resumes from step 4 and logs every loss of the uninterrupted run exactly."""
    out = tmp_path / "run"
    result = restarted_ddp_run(tmp_path, "term-at-step", 4, [*COMMON, "--data", str(tiny_data), "--out", str(out)])
    assert "preempted: stopped after step 4; continue with --resume (exit 143: SIGTERM)" in result.stdout
    assert "exitcode: 143" in result.stderr  # torchrun's report of the first attempt's failure
    assert f"resumed from {out / 'ckpt_00000004.pt'} at step 4" in result.stdout
    assert result.stdout.count("resumed from") == 1
    assert curve(out) == curve(ran(runs, "ddp"))


def checkpoint_name(layout: str, step: int) -> str:
    return f"ckpt_{step:08d}" + (".pt" if layout == "ddp" else "")


def test_a_rank_stopped_mid_step_is_named_within_the_timeout_and_the_restart_resumes_exactly(runs, tiny_data, tmp_path):
    """Rank 1 SIGSTOPped in step 5 (DDP, torchrun --max-restarts 1, a 20 s collective timeout): it raises
    nothing and never ends by itself. The survivor's collective times out, it names rank 1 as stopped in
    one line and kills it, so the restart begins within seconds of the timeout (not after torchrun's own
    30 s shutdown wait), resumes from step 3 and logs every loss of the uninterrupted run exactly."""
    out, log, timeout = tmp_path / "run", tmp_path / "log", 20
    log.mkdir()
    env = {"FASTPT_COLLECTIVE_TIMEOUT": str(timeout), "FAULT_LOG": str(log)}
    result = restarted_ddp_run(tmp_path, "stop-at-step", 5, [*COMMON, "--data", str(tiny_data), "--out", str(out)], env)
    said = [line for line in result.stderr.splitlines() if line.startswith("fastpt: error: rank 0: rank 1 (pid")]
    assert len(said) == 1, result.stderr[-4000:]
    assert " is stopped (SIGSTOP, or frozen) and was killed; a collective failed" in said[0]
    assert "Traceback" not in result.stderr.split(said[0])[0]
    waited = float((log / "attempt1").read_text()) - float((log / "stopped").read_text())
    assert timeout <= waited < timeout + 15, waited
    assert f"resumed from {out / 'ckpt_00000003.pt'}" in result.stdout and result.stdout.count("resumed from") == 1
    assert curve(out) == curve(ran(runs, "ddp"))


def test_ddp_gradients_as_bucket_views_are_bit_identical(runs):
    """DDP's gradients as views into its buckets (fastpt's default, 4 bytes per parameter less) train
    bit for bit as DDP that copies them into the buckets (torchrun_cases.copying_ddp): the same losses
    and the same weights."""
    out, viewed_run = ran(runs, "copying-ddp"), ran(runs, "ddp")
    assert curve(out) == curve(viewed_run)
    copied, viewed = (checkpoint.load(checkpoint.latest(run))["model"] for run in (out, viewed_run))
    assert copied.keys() == viewed.keys() and all(torch.equal(copied[k], viewed[k]) for k in copied)


def test_the_model_options_follow_one_process_under_ddp_and_fsdp(runs):
    """OPTIONS (squared-ReLU MLP, soft-capped logits, U-net skips, the batch warm-up) in every layout."""
    for layout in ("ddp", "fsdp"):
        assert_same_curve(ran(runs, f"options-{layout}"), runs / "options-one")


def test_the_nanochat_recipe_follows_one_process_under_ddp_and_fsdp(runs, tiny_data, tmp_path):
    """NANOCHAT in every layout, and its FSDP checkpoint (DCP shards) resumes in one process as the
    uninterrupted run."""
    for layout in ("ddp", "fsdp"):
        assert_same_curve(ran(runs, f"nanochat-{layout}"), runs / "nanochat-one")
    resumed = resume_from(ran(runs, "nanochat-fsdp"), "ckpt_00000003", tmp_path / "resumed")
    assert_same_curve(train_here(tiny_data, resumed, *NANOCHAT, "--resume"), runs / "nanochat-one", from_step=3)
