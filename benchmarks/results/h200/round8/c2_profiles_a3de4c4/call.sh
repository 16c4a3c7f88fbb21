# profiles: Llama-8B decode at offline-like batches (PDL off: true durations), cuBLAS shapes, fp8 KV offline
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
timeout 120 python3 benchmarks/gpu/gemm_shapes.py --shape llama3-8b --rows 1,64,128,208,256 --out $R/gemm_llama.json > $R/gemm_llama.txt 2>&1; echo "gemm llama rc=$?"
timeout 60 python3 benchmarks/gpu/gemm_shapes.py --shape qwen3-0.6b --rows 64,128,208,256 --out $R/gemm_qwen.json > $R/gemm_qwen.txt 2>&1; echo "gemm qwen rc=$?"
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok"
run() { name=$1; shift; timeout ${T:-120} $P "$@" --out $R/$name.json > $R/log_$name.txt 2>&1; echo "$name rc=$? $(grep -o '"tok_s": [0-9.]*' $R/$name.json 2>/dev/null | head -1)"; }
PHLOEM_PDL=0 run llama_b208_ctx822_nopdl --dummy-shape llama3-8b --batch 208 --input-len 822 --max-new-tokens 16 --decode-steps 8
PHLOEM_PDL=0 run llama_b48_ctx1400_nopdl --dummy-shape llama3-8b --batch 48 --input-len 1400 --max-new-tokens 16 --decode-steps 8
T=150 run llama_prefill_b64 --dummy-shape llama3-8b --window prefill --batch 64 --input-len 1024 --min-input-len 100
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
timeout 80 python3 $O --dummy-shape qwen3-0.6b --kv-cache-dtype fp8_e4m3 > $R/qwen_fp8.txt 2>&1; echo "qwen fp8 $(grep -i 'output throughput' $R/qwen_fp8.txt | tr -s ' ')"
kill $WD 2>/dev/null; pkill -f "sleep 540"
cd $OUT && tar czf r.tgz r && rm -rf r
