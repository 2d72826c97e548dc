"""--activation-checkpointing selective (torchtitan's per-op policy, fastpt.checkpointing) in whole runs:
compiled, resumed, and under torchrun's DDP beside FSDP."""

import pytest

from conftest import eager_and_compiled, read_metrics, run_train, tiny_args


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
def test_a_compiled_selective_run_trains_as_the_eager_one_and_resumes_exactly(tiny_data, tmp_path):
    """Compiled under the op policy (one graph per step: no recompile), the losses are the eager run's;
    resumed from its step-2 checkpoint (the step-4 one removed), the run logs the same losses."""
    flags = dict(activation_checkpointing="selective", max_steps=4, ckpt_every=2, log_every=1)
    _, records, _ = eager_and_compiled(tiny_data, tmp_path, **flags)
    compiled, eager = (losses(tmp_path / mode) for mode in ("compiled", "eager"))
    assert [s for s, _ in compiled] == [s for s, _ in eager] == [1, 2, 3, 4]
    assert [v for _, v in compiled] == pytest.approx([v for _, v in eager], rel=1e-4)
    assert {r["recompiles"] for r in records if "loss" in r} == {0}
    run = tmp_path / "compiled"
    uninterrupted = losses(run)
    (run / "ckpt_00000004.pt").unlink()
    resumed = run_train(*tiny_args(tiny_data, run, "--compile", "--resume", **flags), timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run / 'ckpt_00000002.pt'} at step 2" in resumed.stdout
    assert losses(run) == uninterrupted and len(uninterrupted) == 4
