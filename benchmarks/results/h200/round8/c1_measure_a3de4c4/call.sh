# measure at HEAD: offline Qwen3 (x2, one with a per-step log for the timeline), offline Llama-8B, Llama b1 K=8
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 520; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-80} python3 $O "$@" > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > $R/smi.txt
run qwen1 --dummy-shape qwen3-0.6b
run qwen2 --dummy-shape qwen3-0.6b
run qwen_log --dummy-shape qwen3-0.6b --log-level info --log-interval 1
T=150 run llama1 --dummy-shape llama3-8b
T=150 run llama_log --dummy-shape llama3-8b --log-level info --log-interval 1
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
timeout 100 $P --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64 --decode-steps 8 --out $R/llama_b1_k8.json > $R/log_llama_b1.txt 2>&1; echo "llama b1 $(grep -o '"tok_s": [0-9.]*' $R/llama_b1_k8.json | head -1)"
kill $WD 2>/dev/null; pkill -f "sleep 520"
cd $OUT && tar czf r.tgz r && rm -rf r
