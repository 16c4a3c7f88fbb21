rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b --num-continuous-decode-steps 8"
for order in requests heads; do
  PHLOEM_DECODE_ORDER=$order timeout 115 python3 $O --output-file $R/llama_$order.jsonl > $R/llama_$order.txt 2>&1
  echo "llama $order rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/llama_$order.txt | tr -s ' ')"
done
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b --batch 208 --input-len 822 --max-new-tokens 64 --decode-steps 8 --no-torch-profile"
for order in requests heads; do
  PHLOEM_DECODE_ORDER=$order timeout 90 python3 $SP --out $R/l208_$order.json > $R/l208_$order.txt 2>&1
  echo "l208 $order rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json;print(json.load(open('$R/l208_$order.json'))['timing']['tok_s'])" 2>&1 | tail -1)"
done
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -3 $R/tests.txt
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
