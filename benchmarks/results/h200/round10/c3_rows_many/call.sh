# round 10 call 3: fused rows beyond 16 (programs of 16 rows): kernel tests, row_fused_bench at 16-256 rows, SmolLM2 b64/b32 with fusion up to 16 vs 64 rows, Qwen3 b8 A/B against 07c8b9c (.snapbase), Engine GPU tests
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 585; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
timeout 110 python3 -m pytest -q -m gpu tests/kernels/test_row_fused.py > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
timeout 80 python3 -m benchmarks.gpu.row_fused_bench --rows 16,32,64,128,256 --out $R/row_fused_many.json > $R/row_fused_many.txt 2>&1; echo "bench rc=$?"; tail -31 $R/row_fused_many.txt | head -21
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout ${T:-40} python3 $P "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
B64="--batch 64 --input-len 128 --max-new-tokens 256 --decode-steps 8"
PHLOEM_ROW_FUSION_MAX_ROWS=16 one $ROOT b64_r16_1 $B64
PHLOEM_ROW_FUSION_MAX_ROWS=64 one $ROOT b64_r64_1 $B64
PHLOEM_ROW_FUSION_MAX_ROWS=16 one $ROOT b64_r16_2 $B64
PHLOEM_ROW_FUSION_MAX_ROWS=64 one $ROOT b64_r64_2 $B64
B32="--batch 32 --input-len 128 --max-new-tokens 256 --decode-steps 8"
PHLOEM_ROW_FUSION_MAX_ROWS=16 one $ROOT b32_r16 $B32
PHLOEM_ROW_FUSION_MAX_ROWS=64 one $ROOT b32_r64 $B32
Q8="--dummy-shape qwen3-0.6b --batch 8 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT q8_new $Q8
one $ROOT/.snapbase q8_base $Q8
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 120 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py tests/unit/test_eagle_graphs.py > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 585"
cd $OUT && tar czf r.tgz r && rm -rf r
