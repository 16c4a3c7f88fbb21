# round 21 call f: the decode kernel's GPU tests on the final tile rule (both default launch settings against the backend and torch_ref), the draft attention on the decode kernel, and the fp8 decode cases
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 125; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m5 "^FAILED\|^ERROR\|^E  " $R/$n.txt | cut -c1-250; }
t decode_kernels 115 tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py tests/kernels/test_triton_fp8.py -k "decode or draft"
kill $WD 2>/dev/null; pkill -f "sleep 125"
cd $OUT && tar czf r.tgz r && rm -rf r
