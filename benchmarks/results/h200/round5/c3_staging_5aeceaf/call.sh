# round 5, call 3: tests of staging/PDL through the Engine; A/B 78be311 vs HEAD; offline qwen3
R=$OUT/r; mkdir -p $R; (sleep 520; cd $OUT && tar czf r_partial.tgz r) & WD=$!
cd .snap && rm -rf .whl && cp -r ../.whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
ln -sf ../.gputok .gputok; cd ..; ln -sf ../.gputok .snapbase/.gputok; cd .snap; export GIT_COMMIT=$(cat COMMIT); echo $GIT_COMMIT
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_cuda_graph.py tests/kernels/test_row_fused.py tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py > $R/gpu_tests.txt 2>&1; tail -1 $R/gpu_tests.txt; grep -m5 "FAILED\|Error" $R/gpu_tests.txt
cd ..
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
run() { d=$1; t=$2; shift 2; (cd $d && GIT_COMMIT=$(cat COMMIT) timeout 90 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_cpu_ms_mean": [0-9.]*' $R/$t.json | head -1)"; }
for i in 1 2; do
  run .snapbase smol_b1_base$i --batch 1 --max-new-tokens 256
  run .snap smol_b1_new$i --batch 1 --max-new-tokens 256
done
for i in 1 2; do
  run .snapbase smol_b64_base$i --batch 64 --max-new-tokens 256 --input-len 128
  run .snap smol_b64_new$i --batch 64 --max-new-tokens 256 --input-len 128
done
run .snap llama_b1_new --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
cd .snap
O="python3 -m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda"
RND="--dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0"
L="--log-level info --log-interval 1"
timeout 65 $O --dummy-shape qwen3-0.6b $RND --disable-tqdm $L > $R/offline_qwen3_cold.txt 2>&1
timeout 55 $O --dummy-shape qwen3-0.6b $RND --disable-tqdm $L --output-file $R/offline_qwen3_warm.jsonl > $R/offline_qwen3_warm.txt 2>&1
for f in $R/offline_*.txt; do echo "$(basename $f): $(grep -h 'Output throughput\|Duration' $f | awk '{print $NF}' | tr '\n' ' ')"; done
kill $WD 2>/dev/null; pkill -f "sleep 520" 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
