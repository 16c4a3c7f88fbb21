# round 12 call 3: the rest of the GPU tests (kernels, host tier, grammars' bitmask); SmolLM2 and Llama-3-8B decode at batch 1; the warm-up A/B again on this machine (empty Triton cache each run)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --log-level info --log-interval 100000"
run() { t=$1; shift; export TRITON_CACHE_DIR=/tmp/tc_$t; rm -rf $TRITON_CACHE_DIR; s=$(date +%s); timeout ${T:-100} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t wall=$(( $(date +%s) - s ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/$t.txt | tr -s ' ') $(grep -o 'warm-up:.*' $R/$t.txt) triton_kernels=$(find $TRITON_CACHE_DIR -name '*.json' | wc -l)"; }
run qwen_on_1 --dummy-shape qwen3-0.6b
run qwen_off_1 --dummy-shape qwen3-0.6b --warmup off
run qwen_on_2 --dummy-shape qwen3-0.6b
run qwen_off_2 --dummy-shape qwen3-0.6b --warmup off
unset TRITON_CACHE_DIR
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --input-len 128 --max-new-tokens 256 --decode-steps 8"
for b in 1; do timeout 60 python3 $P --batch $b --out $R/smollm2_b${b}_k8.json > $R/smollm2_b${b}_k8.txt 2>&1; echo "smollm2 b$b rc=$? $(python3 -c "import json; print(json.load(open('$R/smollm2_b${b}_k8.json'))['timing'])" 2>&1 | cut -c1-300)"; done
timeout 110 python3 $P --batch 1 --dummy-shape llama3-8b --out $R/llama_b1_k8.json > $R/llama_b1_k8.txt 2>&1; echo "llama b1 rc=$? $(python3 -c "import json; print(json.load(open('$R/llama_b1_k8.json'))['timing'])" 2>&1 | cut -c1-300)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/grammars/test_bitmask.py tests/kernels/test_argmax_triton.py tests/kernels/test_attention_flashinfer.py tests/kernels/test_attention_triton.py tests/kernels/test_cuda_graph.py tests/kernels/test_fused_triton.py tests/kernels/test_lm_head_float.py tests/kernels/test_skinny_gemm.py tests/kernels/test_tree_verify_triton.py tests/kernels/test_triton_fp8.py tests/unit/test_hicache.py tests/unit/test_host_copy.py > $R/rest.txt 2>&1; echo "rest rc=$? $(tail -1 $R/rest.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
