# torch profiles of offline-like decode steps (Qwen3-0.6B shape) and of Llama-8B batch 1 without PDL (true kernel durations)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null
R=$OUT/r; mkdir -p $R; (sleep 400; cd $OUT && tar czf r_partial.tgz r) & WD=$!
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok"
run() { name=$1; shift; timeout ${T:-90} $P "$@" --out $R/$name.json > $R/log_$name.txt 2>&1; echo "$name rc=$? $(grep -o '"tok_s": [0-9.]*' $R/$name.json 2>/dev/null | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$name.json 2>/dev/null | head -1)"; }
run qwen_b208_ctx822 --dummy-shape qwen3-0.6b --batch 208 --input-len 822 --max-new-tokens 16 --decode-steps 8
run qwen_b24_ctx1550 --dummy-shape qwen3-0.6b --batch 24 --input-len 1550 --max-new-tokens 16 --decode-steps 8
PHLOEM_PDL=0 run qwen_b208_ctx822_nopdl --dummy-shape qwen3-0.6b --batch 208 --input-len 822 --max-new-tokens 16 --decode-steps 8
PHLOEM_PDL=0 T=120 run llama_b1_nopdl --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 32 --decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 400"
cd $OUT && tar czf r.tgz r && rm -rf r
