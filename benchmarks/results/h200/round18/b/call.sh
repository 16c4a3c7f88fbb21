# round 18 call b: the goal table on the final code, one machine, default settings (dummy bf16 weights)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 525; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; lim=$2; shift 2; timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*' $R/$t.json 2>/dev/null | head -1)"; }
off qwen 90 --dummy-shape qwen3-0.6b
off llama_bf16 150 --dummy-shape llama3-8b --num-continuous-decode-steps 8
off llama_fp8 120 --dummy-shape llama3-8b --kv-cache-dtype fp8_e4m3 --num-continuous-decode-steps 8
st smol_b1 40 --batch 1 --input-len 128 --max-new-tokens 256
st smol_b64 40 --batch 64 --input-len 128 --max-new-tokens 256
st llama_b1 70 --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
st llama_b64 $(( 515 - $(date +%s) + t0 )) --dummy-shape llama3-8b --batch 64 --input-len 128 --max-new-tokens 128
kill $WD 2>/dev/null; pkill -f "sleep 525"
cd $OUT && tar czf r.tgz r && rm -rf r
