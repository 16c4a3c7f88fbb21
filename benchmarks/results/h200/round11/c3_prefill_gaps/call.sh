# round 11 call 3: where a prefill pass's GPU idle comes from (trace without stacks, cProfile of both threads)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 280; cd $OUT && tar czf r_partial.tgz r) & WD=$!
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --window prefill --max-new-tokens 2 --dummy-shape qwen3-0.6b"
timeout 80 python3 $P --batch 64 --input-len 1024 --min-input-len 100 --keep-trace --cprofile --out $R/prefill_qwen3_b64.json > $R/prefill_qwen3_b64.txt 2>&1; echo "b64 rc=$?"
timeout 80 python3 $P --batch 192 --input-len 1024 --min-input-len 100 --keep-trace --out $R/prefill_qwen3_b192.json > $R/prefill_qwen3_b192.txt 2>&1; echo "b192 rc=$?"
python3 -m benchmarks.gpu.trace_gaps $R/prefill_qwen3_b192.trace.json.gz --min-gap-us 20 --top 12 > $R/gaps_b192.txt 2>&1; head -30 $R/gaps_b192.txt
python3 -c "import json; d=json.load(open('$R/prefill_qwen3_b192.json')); print(d['timing'], d['gpu'])"
kill $WD 2>/dev/null; pkill -f "sleep 280"
cd $OUT && tar czf r.tgz r && rm -rf r
