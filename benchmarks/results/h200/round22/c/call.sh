# round 22 call c: the goal table on the final code, one machine, default settings (dummy bf16 weights): Llama-3-8B offline with a bf16 KV cache twice and fp8 once, then the batch-1 and batch-64 decode goals
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $R/smi.txt 2>&1
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|duration' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; }
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; lim=$2; shift 2; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*' $R/$t.json 2>/dev/null | head -1)"; }
off llama_bf16_1 150 --dummy-shape llama3-8b
off llama_bf16_2 125 --dummy-shape llama3-8b
off llama_fp8 125 --dummy-shape llama3-8b --kv-cache-dtype fp8_e4m3
st llama_b1 $(( 480 - $(date +%s) + t0 < 60 ? 480 - $(date +%s) + t0 : 60 )) --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
st llama_b64 $(( 520 - $(date +%s) + t0 < 50 ? 520 - $(date +%s) + t0 : 50 )) --dummy-shape llama3-8b --batch 64 --input-len 128 --max-new-tokens 128
st smol_b1 $(( 545 - $(date +%s) + t0 < 35 ? 545 - $(date +%s) + t0 : 35 )) --batch 1 --input-len 128 --max-new-tokens 256
st smol_b64 $(( 568 - $(date +%s) + t0 < 35 ? 568 - $(date +%s) + t0 : 35 )) --batch 64 --input-len 128 --max-new-tokens 256
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
