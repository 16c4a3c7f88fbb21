# round 24 call a: the one-row loop options swept on Llama-3-8B's shapes, HEAD's kernels as the baseline, then Llama-3-8B batch 1 end to end (HEAD against the sweep's picks), GPU kernel tests if time is left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 565; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
left() { echo $(( $1 - $(date +%s) + t0 )); }
B="python3 -m benchmarks.gpu.row_loop_bench"
lb() { t=$1; lim=$2; shift 2; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; timeout $lim $B "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s"; tail -1 $R/$t.txt; }
lb llama_sweep 250 --shape llama3-8b
cp runtime/layers/row_fused.py /tmp/rf.new; cp runtime/layers/skinny_gemm.py /tmp/sk.new
head_code() { cp .snapbase/row_fused.py .snapbase/skinny_gemm.py runtime/layers/; }
new_code() { cp /tmp/rf.new runtime/layers/row_fused.py; cp /tmp/sk.new runtime/layers/skinny_gemm.py; }
head_code; lb llama_head 45 --shape llama3-8b --baseline; new_code
P="--load-format dummy --tokenizer-path .gputok --no-torch-profile --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64"
st() { t=$1; lim=$2; shift 2; [ $lim -lt 25 ] && { echo "$t skipped"; return; }; timeout $lim python3 "$@" $P --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -2 | tr '\n' ' ')"; }
PS="benchmarks/results/h200/round24/patched_step.py $R/llama_sweep.json"
st llama_b1_new1 $(( $(left 540) < 110 ? $(left 540) : 110 )) $PS
head_code; st llama_b1_head1 $(( $(left 540) < 90 ? $(left 540) : 90 )) benchmarks/gpu/step_profile.py; new_code
st llama_b1_new2 $(( $(left 540) < 80 ? $(left 540) : 80 )) $PS
head_code; st llama_b1_head2 $(( $(left 540) < 80 ? $(left 540) : 80 )) benchmarks/gpu/step_profile.py; new_code
L=$(left 550); [ $L -gt 30 ] && { timeout $L python3 -m pytest -q -m gpu tests/kernels/test_row_fused.py tests/kernels/test_skinny_gemm.py -x > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"; }
kill $WD 2>/dev/null; pkill -f "sleep 565"
cd $OUT && tar czf r.tgz r && rm -rf r
