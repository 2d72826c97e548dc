"""fastpt benchmarks: train-step tok/s, peak memory and MFU per mode, and a kernel table.

python -m bench [--preset P] [--modes LIST] ...   train-step table (see bench/train_step.py)
python -m bench kernels [--json PATH]             kernel table (see bench/kernel_table.py)
python -m bench prepare [...]                     fastpt.prepare vs raw encode (see bench/prepare_bench.py)
"""
