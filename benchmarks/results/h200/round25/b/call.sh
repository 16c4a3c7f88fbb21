# round 25 call b: GPU tests of the decode path with the step's token in the kernel (attention, fp8, draft attention, no-sync, CUDA graphs, Engine decode, HTTP server), then the goal runs: Llama-3-8B offline (bf16 KV) with it and with PHLOEM_DECODE_ROPE=0, Qwen3-0.6B offline, SmolLM2 batch 64
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 565; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout 210 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py tests/kernels/test_triton_fp8.py tests/kernels/test_draft_attention.py tests/kernels/test_forward_no_sync.py tests/kernels/test_cuda_graph.py tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"
(cd $OUT && tar czf r.tgz r)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; rope=$2; lim=$3; shift 3; [ $lim -lt 30 ] && { echo "$t skipped"; return; }; PHLOEM_DECODE_ROPE=$rope timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; (cd $OUT && tar czf r.tgz r); }
off llama_bf16_new 1 $(( $(left 545) < 130 ? $(left 545) : 130 )) --dummy-shape llama3-8b
off llama_bf16_old 0 $(( $(left 545) < 120 ? $(left 545) : 120 )) --dummy-shape llama3-8b
off qwen_new 1 $(( $(left 545) < 60 ? $(left 545) : 60 )) --dummy-shape qwen3-0.6b
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
L=$(left 550); [ $L -gt 20 ] && { timeout $L python3 $P --batch 64 --input-len 128 --max-new-tokens 256 --out $R/smol_b64.json > $R/smol_b64.txt 2>&1; echo "smol_b64 rc=$? $(grep -o '"tok_s": [0-9.]*' $R/smol_b64.json)"; }
L=$(left 550); [ $L -gt 75 ] && { timeout $L python3 $P --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64 --out $R/llama_b1.json > $R/llama_b1.txt 2>&1; echo "llama_b1 rc=$? $(grep -o "\"tok_s\": [0-9.]*" $R/llama_b1.json)"; }
kill $WD 2>/dev/null; pkill -f "sleep 565"
cd $OUT && tar czf r.tgz r && rm -rf r
