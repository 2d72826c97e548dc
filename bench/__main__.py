"""python -m bench [train-step options] | python -m bench COMMAND [its options], COMMAND one of
kernels (kernel table), aot (the sm_90 compile table), prepare (fastpt.prepare vs raw encode),
soak (a long run watched for leaks), race (time to the seed recipe's loss per option), plan (fastpt.plan
against the CPU allocator, and its speed), results (a stored results folder's archive: unpack, pack, re-make
its table)."""

import importlib
import sys

COMMANDS = {
    "kernels": "bench.kernel_table",
    "aot": "bench.aot",
    "prepare": "bench.prepare_bench",
    "soak": "bench.soak",
    "race": "bench.race",
    "plan": "bench.plan_check",
    "results": "bench.results_archive",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    from bench.train_step import main as train_step_main

    return train_step_main(argv)


if __name__ == "__main__":
    sys.exit(main())
