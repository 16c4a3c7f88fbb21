# round 5, final call: A/B 88f51d7 vs HEAD (SmolLM2 b1, b64), HEAD at b256, Llama-8B b1/b64, profiles, offline qwen3 cold
R=$OUT/r; mkdir -p $R; (sleep 330; cd $OUT && tar czf r_partial.tgz r) & WD=$!
cd .snap && rm -rf .whl && cp -r ../.whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
ln -sf ../.gputok .gputok; cd ..; ln -sf ../.gputok .snapbase/.gputok
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
run() { d=$1; t=$2; shift 2; (cd $d && GIT_COMMIT=$(cat COMMIT) timeout 60 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_cpu_ms_mean": [0-9.]*' $R/$t.json | head -1) $(grep -o '"worker_cpu_ms_mean": [0-9.]*' $R/$t.json | head -1)"; }
for i in 1 2; do
  run .snapbase smol_b1_base$i --batch 1 --max-new-tokens 64
  run .snap smol_b1_new$i --batch 1 --max-new-tokens 64
  run .snapbase smol_b64_base$i --batch 64 --max-new-tokens 64
  run .snap smol_b64_new$i --batch 64 --max-new-tokens 64
done
run .snap smol_b256_new --batch 256 --max-new-tokens 64
run .snap llama_b1_new --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
run .snap llama_b64_new --batch 64 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
run .snap smol_b1_cprof --batch 1 --max-new-tokens 128 --cprofile
cd .snap
O="python3 -m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda"
RND="--dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0"
GIT_COMMIT=$(cat COMMIT) timeout 65 $O --dummy-shape qwen3-0.6b $RND --disable-tqdm --log-level info --log-interval 1 > $R/offline_qwen3_cold.txt 2>&1
echo "offline cold: $(grep -h 'Output throughput\|Duration' $R/offline_qwen3_cold.txt | awk '{print $NF}' | tr '\n' ' ')"
kill $WD 2>/dev/null; pkill -f "sleep 330" 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
