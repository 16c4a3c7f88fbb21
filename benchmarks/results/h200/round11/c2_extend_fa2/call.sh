# round 11 call 2: the FlashAttention-2-style extend kernel: GPU tests, sweeps against the old kernel (.snapbase), offline, prefill trace
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 578; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_triton.py tests/kernels/test_triton_fp8.py tests/integration/test_engine_decode_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/tests.txt)"
(cd .snapbase && timeout 40 python3 -m benchmarks.gpu.attention_bench --extend-sweep qwen3-0.6b --extend-grid 64:32:4:2 --out $R/old_qwen.json > $R/old_qwen.txt 2>&1); echo "old qwen rc=$?"; tail -2 $R/old_qwen.txt | cut -c1-300
(cd .snapbase && timeout 40 python3 -m benchmarks.gpu.attention_bench --extend-sweep llama3-8b --extend-grid 64:32:4:2 --out $R/old_llama.json > $R/old_llama.txt 2>&1); echo "old llama rc=$?"; tail -2 $R/old_llama.txt | cut -c1-300
timeout 40 python3 -m benchmarks.gpu.attention_bench --extend-sweep llama3-8b --extend-grid 64,128:64:8:3:1,2 --out $R/new_llama.json > $R/new_llama.txt 2>&1; echo "new llama rc=$?"; tail -4 $R/new_llama.txt | cut -c1-300
timeout 40 python3 -m benchmarks.gpu.attention_bench --extend-sweep qwen3-0.6b --kv-dtype fp8_e4m3 --extend-grid 64:64:8:3:2 --out $R/new_qwen_fp8.json > $R/new_qwen_fp8.txt 2>&1; echo "new qwen fp8 rc=$?"; tail -3 $R/new_qwen_fp8.txt | cut -c1-300
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b"
run() { t=$1; shift; timeout 60 python3 $O "$@" > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
runold() { t=$1; shift; (cd .snapbase && timeout 60 python3 $O "$@" > $R/$t.txt 2>&1); echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
run qwen_new1 --output-file $R/qwen_new1.jsonl
runold qwen_old1
run qwen_new2 --output-file $R/qwen_new2.jsonl
runold qwen_old2
timeout 60 python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --window prefill --batch 64 --input-len 1024 --min-input-len 100 --max-new-tokens 2 --dummy-shape qwen3-0.6b --keep-trace --out $R/prefill_qwen3.json > $R/prefill_qwen3.txt 2>&1; echo "prefill trace rc=$?"
timeout 100 python3 -m benchmarks.gpu.attention_bench --extend-sweep qwen3-0.6b --out $R/new_qwen.json > $R/new_qwen.txt 2>&1; echo "new qwen sweep rc=$?"; sort -t, -k1 $R/new_qwen.txt | tail -3 | cut -c1-300
kill $WD 2>/dev/null; pkill -f "sleep 578"
cd $OUT && tar czf r.tgz r && rm -rf r
