# round 23 call d: the final code (41d0a1b, bd91d9f): decode GPU tests, the four-engine batch check of call c (batches now reach the scheduler in one message), SmolLM2 batch 1 and 64, Qwen3-0.6B offline, Llama-3-8B offline if time is left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout 230 python3 -m pytest -q -m gpu tests/kernels/test_argmax_triton.py tests/integration/test_engine_decode_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"
PHLOEM_PDL=1 timeout 110 python3 benchmarks/results/h200/round23/c/flake.py > $R/flake.json 2> $R/flake.log; echo "flake rc=$? $(( $(date +%s) - t0 ))s $(cat $R/flake.json)"
grep "=== engine\|Prefill batch" $R/flake.log | sed 's/.*\(=== engine.*\|Prefill batch. #new-seq: [0-9]*, #new-token: [0-9]*, #cached-token: [0-9]*\).*/\1/' > $R/flake_prefills.txt
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; lim=$2; shift 2; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"worker_cpu_ms_mean": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -3 | tr '\n' ' ')"; }
st smol_b1_1 40 --batch 1 --input-len 128 --max-new-tokens 256
st smol_b1_2 40 --batch 1 --input-len 128 --max-new-tokens 256
st smol_b64 40 --batch 64 --input-len 128 --max-new-tokens 256
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; [ $lim -lt 30 ] && { echo "$t skipped"; return; }; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; }
off qwen $(( $(left 555) < 70 ? $(left 555) : 70 )) --dummy-shape qwen3-0.6b
off llama_bf16 $(left 555) --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
