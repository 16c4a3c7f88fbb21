# round 27 call c: the other GPU tests on the current code: the decode path end to end (no-sync forward, CUDA graphs, Engine decode, HTTP server), then fp8 attention, draft attention, tree verify, speculative decoding and the host cache tier on CUDA, EAGLE graphs, the speculative window; then the small kernel files (argmax, float LM head, grammar bitmask, host copies, host cache unit, FlashInfer) in the time left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout $(left 250) python3 -m pytest -q -m gpu tests/kernels/test_forward_no_sync.py tests/kernels/test_cuda_graph.py tests/integration/test_engine_decode_cuda.py tests/integration/test_server_cuda.py -rA > $R/tests_e2e.txt 2>&1; echo "tests_e2e rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_e2e.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_e2e.txt | cut -c1-200
(cd $OUT && tar czf r.tgz r)
timeout $(left 520) python3 -m pytest -q -m gpu tests/kernels/test_triton_fp8.py tests/kernels/test_draft_attention.py tests/kernels/test_tree_verify_triton.py tests/integration/test_engine_speculative_cuda.py tests/integration/test_hicache_cuda.py tests/unit/test_eagle_graphs.py tests/unit/test_spec_window.py -rA > $R/tests_rest.txt 2>&1; echo "tests_rest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_rest.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_rest.txt | cut -c1-200
(cd $OUT && tar czf r.tgz r)
timeout $(left 570) python3 -m pytest -q -m gpu tests/kernels/test_argmax_triton.py tests/kernels/test_lm_head_float.py tests/grammars/test_bitmask.py tests/unit/test_host_copy.py tests/unit/test_hicache.py tests/kernels/test_attention_flashinfer.py -rA > $R/tests_small.txt 2>&1; echo "tests_small rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_small.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_small.txt | cut -c1-200
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
