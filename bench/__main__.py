"""python -m bench [train-step options] | python -m bench kernels [kernel-table options]
| python -m bench prepare [prepare options] | python -m bench aot [sm_90 compile-table options]"""
import sys


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["kernels"]:
        from bench.kernel_table import main as kernel_main
        return kernel_main(argv[1:])
    if argv[:1] == ["prepare"]:
        from bench.prepare_bench import main as prepare_main
        return prepare_main(argv[1:])
    if argv[:1] == ["aot"]:
        from bench.aot import main as aot_main
        return aot_main(argv[1:])
    from bench.train_step import main as train_step_main
    return train_step_main(argv)


if __name__ == "__main__":
    sys.exit(main())
