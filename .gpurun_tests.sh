#!/usr/bin/env bash
source benchmarks/gpu/setup_h200.sh install
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
python3 -m pip install -q --no-index --no-deps --target $HOME/site2 .whl2/*.whl
export PYTHONPATH=$HOME/site2:$PYTHONPATH
timeout 560 python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_memory_occupation_cuda.py tests/integration/test_weight_sync_gpu.py \
  tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py \
  tests/integration/test_engine_grammar_cuda.py -k "not nccl" 2>&1 | tail -40
