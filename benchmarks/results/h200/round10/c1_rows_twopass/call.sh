# round 10 call 1: few-row norm + projection kernel: GPU tests (kernels, EAGLE head, Engine), row_fused_bench at 1-16 rows, SmolLM2 batch 4/8 and EAGLE b1 A/B against HEAD (.snapbase)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 580; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
timeout 170 python3 -m pytest -q -m gpu tests/kernels/test_row_fused.py tests/unit/test_eagle_graphs.py > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 120 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
timeout 90 python3 -m benchmarks.gpu.row_fused_bench --rows 2,5,16 --out $R/row_fused_rows.json > $R/row_fused_rows.txt 2>&1; echo "bench rc=$?"; tail -20 $R/row_fused_rows.txt
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout ${T:-40} python3 $P "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
C="--batch 1 --max-new-tokens 128 --spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
T16="--batch 1 --max-new-tokens 128 --spec EAGLE --spec-steps 5 --spec-topk 4 --spec-draft-tokens 16"
one $ROOT chain_new1 $C
one $ROOT/.snapbase chain_base1 $C
one $ROOT tree_new1 $T16
one $ROOT/.snapbase tree_base1 $T16
B8="--batch 8 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT b8_new1 $B8
one $ROOT/.snapbase b8_base1 $B8
kill $WD 2>/dev/null; pkill -f "sleep 580"
cd $OUT && tar czf r.tgz r && rm -rf r
