#!/bin/bash
# Plans of issue 32's measured configs under torch 2.11 (venv) and 2.13 (system), same code.
cd /work/main
for py in /work/venv211/bin/python python; do
  v=$($py -c "import torch;print(torch.__version__.split('+')[0])")
  for mb in "16 4 eager" "16 4" "32 2" "64 1" "128 1"; do
    set -- $mb
    flags="--preset 0.04b --kernels torch --dtype bf16 --seq-len 1024 --micro-batch $1 --grad-accum $2 --plan --plan-gpu h200"
    tag="$v-$1x$2"; if [ "$3" = eager ]; then tag="$tag-eager"; else flags="$flags --compile"; fi
    /usr/bin/time -f "%e s" nice $py -m fastpt.train $flags --plan-json /work/v211/$tag.json > /work/v211/$tag.txt 2>&1
    echo "$tag $(tail -1 /work/v211/$tag.txt)"
  done
done
