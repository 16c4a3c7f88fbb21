# round 11 call 1: offline throughput with the client's tokenizer work outside the window (A/B against the old harness), prefill profile
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-75} python3 $O "$@" > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
runold() { t=$1; shift; (cd .snapbase && timeout ${T:-75} python3 $O "$@" > $R/$t.txt 2>&1); echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
runold qwen_old1 --dummy-shape qwen3-0.6b
run qwen_new1 --dummy-shape qwen3-0.6b --output-file $R/qwen_new1.jsonl
runold qwen_old2 --dummy-shape qwen3-0.6b
run qwen_new2 --dummy-shape qwen3-0.6b
run qwen_k8 --dummy-shape qwen3-0.6b --num-continuous-decode-steps 8 --output-file $R/qwen_k8.jsonl
run qwen_fp8_k8 --dummy-shape qwen3-0.6b --kv-cache-dtype fp8_e4m3 --num-continuous-decode-steps 8 --output-file $R/qwen_fp8_k8.jsonl
T=130 run llama_k8 --dummy-shape llama3-8b --num-continuous-decode-steps 8 --output-file $R/llama_k8.jsonl
T=130 run llama_fp8_k8 --dummy-shape llama3-8b --kv-cache-dtype fp8_e4m3 --num-continuous-decode-steps 8 --output-file $R/llama_fp8_k8.jsonl
timeout 80 python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --window prefill --batch 64 --input-len 1024 --min-input-len 100 --max-new-tokens 2 --dummy-shape qwen3-0.6b --out $R/prefill_qwen3.json > $R/prefill_qwen3.txt 2>&1; echo "prefill profile rc=$?"; tail -3 $R/prefill_qwen3.txt
T=45 run qwen_log --dummy-shape qwen3-0.6b --log-level info --log-interval 1
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
