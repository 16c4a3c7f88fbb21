# round 15 call d: Qwen3-0.6B offline, K = 1 against auto (alternating, K = 1 first); Llama-3-8B batch 1 at auto
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 480; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-60} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
for i in 1 2; do
run qwen_k1_$i --dummy-shape qwen3-0.6b --num-continuous-decode-steps 1
run qwen_auto_$i --dummy-shape qwen3-0.6b --log-level info --log-interval 1
done
timeout 120 python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --batch 1 --input-len 128 --max-new-tokens 64 --dummy-shape llama3-8b --out $R/l_b1_auto.json > $R/l_b1_auto.txt 2>&1; echo "llama b1 auto $(python3 -c "import json;d=json.load(open('$R/l_b1_auto.json'))['timing'];print(round(d['tok_s'],1), round(d['tokens_per_step'],2))")"
kill $WD 2>/dev/null; pkill -f "sleep 480"
cd $OUT && tar czf r.tgz r && rm -rf r
