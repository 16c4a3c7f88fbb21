# round 9 call 2: norm + qkv + RoPE + K/V store in one kernel at batch 1: GPU tests; SmolLM2 and Llama-8B batch 1 A/B against HEAD (.snapbase); fp8 extend f16 dot A/B
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD; ln -sf ../.gputok .snapbase/.gputok
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_row_fused.py tests/kernels/test_fused_triton.py -k "rope or row or fused_matches or folding" > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 100 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
timeout 45 python3 -m benchmarks.gpu.attention_bench --extend-sweep qwen3-0.6b --kv-dtype fp8_e4m3 --extend-grid 64:32,64:4:2 --out $R/extend_fp8_qwen.json > $R/extend_fp8_qwen.txt 2>&1; echo "extend rc=$?"
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout ${T:-40} python3 $P "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1)"; }
one $ROOT smol_new1 --batch 1 --max-new-tokens 256 --decode-steps 8
one $ROOT/.snapbase smol_base1 --batch 1 --max-new-tokens 256 --decode-steps 8
one $ROOT smol_new2 --batch 1 --max-new-tokens 256 --decode-steps 8
one $ROOT/.snapbase smol_base2 --batch 1 --max-new-tokens 256 --decode-steps 8
L="--dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 256 --decode-steps 8"
T=85 one $ROOT llama_new1 $L
T=85 one $ROOT/.snapbase llama_base1 $L
T=85 one $ROOT llama_new2 $L
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
