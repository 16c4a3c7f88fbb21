# lm head float32 output + fp8 K/V written by rope_store_: GPU tests, offline Qwen3 A/B against HEAD, fp8 offline
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD; ln -sf ../.gputok .snapbase/.gputok
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_lm_head_float.py tests/kernels/test_fused_triton.py -k "lm_head or fp8 or rope_store or fused_matches" > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 120 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b"
run() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout 70 python3 $O "$@" > $R/$t.txt 2>&1); echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
run $ROOT new_warm
run $ROOT/.snapbase base1
run $ROOT new1
run $ROOT new_k8_1 --num-continuous-decode-steps 8
run $ROOT/.snapbase base2
run $ROOT new2
run $ROOT new_k8_2 --num-continuous-decode-steps 8
run $ROOT new_fp8 --kv-cache-dtype fp8_e4m3
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
