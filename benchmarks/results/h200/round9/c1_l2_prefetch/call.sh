# round 9 call 1: GPU tests of the L2 prefetch and fp8 extend; Llama b1 and SmolLM2 b1 with prefetch budgets; fp8 extend sweep
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > $R/smi.txt
timeout 170 python3 -m pytest -q -x tests/kernels/test_skinny_gemm.py tests/kernels/test_row_fused.py tests/kernels/test_triton_fp8.py tests/unit/test_pdl.py > $R/gpu_tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/gpu_tests.txt)"
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
lb1() { PHLOEM_L2_PREFETCH_MB=$1 timeout 100 $P --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 256 --decode-steps 8 --out $R/llama_b1_pf$1_$2.json > $R/log_llama_b1_pf$1_$2.txt 2>&1; echo "llama b1 pf=$1 ($2) $(grep -o '"tok_s": [0-9.]*' $R/llama_b1_pf$1_$2.json | head -1)"; }
sb1() { PHLOEM_L2_PREFETCH_MB=$1 timeout 60 $P --batch 1 --max-new-tokens 256 --decode-steps 8 --out $R/smol_b1_pf$1_$2.json > $R/log_smol_b1_pf$1_$2.txt 2>&1; echo "smol b1 pf=$1 ($2) $(grep -o '"tok_s": [0-9.]*' $R/smol_b1_pf$1_$2.json | head -1)"; }
lb1 0 a; lb1 32 a; lb1 64 a; lb1 0 b; lb1 32 b
sb1 0 a; sb1 32 a; sb1 0 b; sb1 32 b
timeout 80 python3 -m benchmarks.gpu.attention_bench --extend-sweep qwen3-0.6b --kv-dtype fp8_e4m3 --out $R/extend_fp8_qwen.json > $R/extend_fp8_qwen.txt 2>&1; echo "extend rc=$?"
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
