# round 22 call d: the batch-1 and batch-64 decode goals that call c cut short (first use of those shapes compiles kernels), SmolLM2 batch 1 again, a third Llama-3-8B bf16 offline run
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 490; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $R/smi.txt 2>&1
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|duration' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; }
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; lim=$2; shift 2; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*' $R/$t.json 2>/dev/null | head -1)"; }
st llama_b1 120 --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
st llama_b64 100 --dummy-shape llama3-8b --batch 64 --input-len 128 --max-new-tokens 128
st smol_b1 40 --batch 1 --input-len 128 --max-new-tokens 256
off llama_bf16_3 $(( 470 - $(date +%s) + t0 )) --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 490"
cd $OUT && tar czf r.tgz r && rm -rf r
