# round 11 call 5: GPU tests touched by the prefill-chunk default; offline and shared prefix at the new default
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 470; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --disable-tqdm --dummy-shape qwen3-0.6b"
W="--dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0"
S="--dataset shared-prefix --num-groups 4 --prompts-per-group 16 --prefix-len 2048 --question-len 128 --output-len 256 --max-concurrency 16"
run() { t=$1; shift; timeout 60 python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/$t.txt | tr -s ' ')"; }
run qwen_default_1 $W --log-level info --log-interval 1000
grep -o "chunked_prefill_size=[0-9]*" $R/qwen_default_1.txt | head -1
run qwen_default_k8 $W --num-continuous-decode-steps 8
run qwen_default_2 $W
run shared_default $S
run shared_c8k $S --chunked-prefill-size 8192
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py tests/kernels/test_cuda_graph.py tests/integration/test_hicache_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/tests.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 470"
cd $OUT && tar czf r.tgz r && rm -rf r
