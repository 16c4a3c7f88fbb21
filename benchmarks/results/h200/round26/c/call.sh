# round 26 call c: the rest of the GPU tests (fp8 attention, draft attention, tree verify, speculative decoding and the host cache tier on CUDA), then Llama-3-8B offline with a bf16 KV cache: the step's token in rope_store_ (PHLOEM_DECODE_ROPE=0) first, then in the decode kernel
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_triton_fp8.py tests/kernels/test_draft_attention.py tests/kernels/test_tree_verify_triton.py tests/integration/test_engine_speculative_cuda.py tests/integration/test_hicache_cuda.py tests/unit/test_eagle_graphs.py tests/unit/test_spec_window.py -rA > $R/tests_rest.txt 2>&1; echo "tests_rest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_rest.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_rest.txt | cut -c1-200
(cd $OUT && tar czf r.tgz r)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; rope=$2; lim=$3; shift 3; [ $lim -lt 30 ] && { echo "$t skipped"; return; }; PHLOEM_DECODE_ROPE=$rope timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; (cd $OUT && tar czf r.tgz r); }
off llama_bf16_old 0 $(( $(left 560) < 130 ? $(left 560) : 130 )) --dummy-shape llama3-8b
off llama_bf16_new 1 $(( $(left 560) < 120 ? $(left 560) : 120 )) --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
