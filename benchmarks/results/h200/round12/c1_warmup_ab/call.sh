# round 12 call 1: the start-up warm-up. Offline Qwen3-0.6B with --warmup off / on (default), each run with an empty Triton cache (a fresh machine), alternating; then GPU tests of the Engine, server, host tier and speculative decoding with the warm-up on
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --log-level info --log-interval 100000"
run() { t=$1; shift; export TRITON_CACHE_DIR=/tmp/tc_$t; rm -rf $TRITON_CACHE_DIR; s=$(date +%s); timeout ${T:-100} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t wall=$(( $(date +%s) - s ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/$t.txt | tr -s ' ') $(grep -o 'warm-up:.*' $R/$t.txt) triton_kernels=$(find $TRITON_CACHE_DIR -name '*.json' | wc -l)"; }
run qwen_off_1 --dummy-shape qwen3-0.6b --warmup off
run qwen_on_1 --dummy-shape qwen3-0.6b
run qwen_off_2 --dummy-shape qwen3-0.6b --warmup off
run qwen_on_2 --dummy-shape qwen3-0.6b
unset TRITON_CACHE_DIR
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py tests/integration/test_hicache_cuda.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/tests.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
