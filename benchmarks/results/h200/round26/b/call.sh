# round 26 call b: the auto continuous decode mismatch of round 25 (benchmarks/results/h200/round26/flake.py: engines of 1 step a launch and auto, the step's token in the decode kernel, prefill passes logged), then the GPU tests of the decode path end to end (no-sync, CUDA graphs, Engine decode, HTTP server; the L2 prefetch on by default) and the whole attention file
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok PHLOEM_PDL=1
left() { echo $(( $1 - $(date +%s) + t0 )); }
F=benchmarks/results/h200/round26/flake.py
sed -i 's/^RUNS = .*/RUNS = [(1, "1"), (0, "1"), (1, "1"), (0, "1")]/' $F
timeout 150 python3 $F > $R/flake.json 2> $R/flake.log; echo "flake rc=$? $(( $(date +%s) - t0 ))s"; cat $R/flake.json
grep "=== engine\|Prefill batch" $R/flake.log | sed 's/.*\(=== engine.*\|Prefill batch. #new-seq: [0-9]*, #new-token: [0-9]*, #cached-token: [0-9]*\).*/\1/' > $R/flake_prefills.txt
(cd $OUT && tar czf r.tgz r)
unset PHLOEM_PDL
timeout $(left 330) python3 -m pytest -q -m gpu tests/kernels/test_forward_no_sync.py tests/kernels/test_cuda_graph.py tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py -rA > $R/tests_e2e.txt 2>&1; echo "tests_e2e rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_e2e.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_e2e.txt | cut -c1-200
(cd $OUT && tar czf r.tgz r)
timeout $(left 565) python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py -x > $R/tests_attn.txt 2>&1; echo "tests_attn rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_attn.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_attn.txt | cut -c1-200
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
