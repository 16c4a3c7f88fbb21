# round 27 call b: the whole Triton attention GPU test file on the current code, then the fused, row-fused and skinny kernel files in the time left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout $(left 420) python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py -rA > $R/tests_attn.txt 2>&1; echo "tests_attn rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_attn.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_attn.txt | cut -c1-200
(cd $OUT && tar czf r.tgz r)
timeout $(left 570) python3 -m pytest -q -m gpu tests/kernels/test_fused_triton.py tests/kernels/test_row_fused.py tests/kernels/test_skinny_gemm.py -rA > $R/tests_fused.txt 2>&1; echo "tests_fused rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_fused.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_fused.txt | cut -c1-200
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
