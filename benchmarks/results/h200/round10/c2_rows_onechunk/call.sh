# round 10 call 2: few-row norm + projection kernel, one-chunk route: kernel tests, row_fused_bench sweep at 5 and 16 rows, SmolLM2 batch 8 / batch 4 and EAGLE b1 A/B against HEAD (.snapbase)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 580; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_row_fused.py > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
timeout 170 python3 -m benchmarks.gpu.row_fused_bench --rows 5,16 --sweep --out $R/row_fused_sweep.json > $R/row_fused_sweep.txt 2>&1; echo "bench rc=$?"; tail -14 $R/row_fused_sweep.txt; grep -o '"rows": [0-9]*\|"best": \[{[^}]*}' $R/row_fused_sweep.txt
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout ${T:-40} python3 $P "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
B8="--batch 8 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT b8_new1 $B8
one $ROOT/.snapbase b8_base1 $B8
one $ROOT b8_new2 $B8
one $ROOT/.snapbase b8_base2 $B8
C="--batch 1 --max-new-tokens 128 --spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
T16="--batch 1 --max-new-tokens 128 --spec EAGLE --spec-steps 5 --spec-topk 4 --spec-draft-tokens 16"
one $ROOT chain_new1 $C
one $ROOT/.snapbase chain_base1 $C
one $ROOT tree_new1 $T16
one $ROOT/.snapbase tree_base1 $T16
kill $WD 2>/dev/null; pkill -f "sleep 580"
cd $OUT && tar czf r.tgz r && rm -rf r
