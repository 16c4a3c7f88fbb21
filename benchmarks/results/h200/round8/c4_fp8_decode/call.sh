# fp8 KV decode: float16 dots and 128-key blocks; kernel tests, decode sweeps (fp8 vs bf16), offline fp8 vs bf16
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_triton_fp8.py tests/kernels/test_fused_triton.py -k "fp8" > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
timeout 100 python3 -m benchmarks.gpu.attention_bench --decode-sweep qwen3-0.6b:208:822 --kv-dtype fp8_e4m3 --out $R/sweep_qwen_fp8.json > $R/sweep_qwen_fp8.txt 2>&1; echo "sweep qwen fp8 rc=$?"; tail -12 $R/sweep_qwen_fp8.txt | cut -c1-250
timeout 60 python3 -m benchmarks.gpu.attention_bench --decode-sweep qwen3-0.6b:208:822 --out $R/sweep_qwen_bf16.json > $R/sweep_qwen_bf16.txt 2>&1; echo "sweep qwen bf16 rc=$?"; tail -5 $R/sweep_qwen_bf16.txt | cut -c1-250
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-75} python3 $O "$@" > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
run qwen_fp8_1 --dummy-shape qwen3-0.6b --kv-cache-dtype fp8_e4m3
run qwen_bf16_1 --dummy-shape qwen3-0.6b
run qwen_fp8_k8 --dummy-shape qwen3-0.6b --kv-cache-dtype fp8_e4m3 --num-continuous-decode-steps 8
T=130 run llama_k8 --dummy-shape llama3-8b --num-continuous-decode-steps 8
T=130 run llama_fp8_k8 --dummy-shape llama3-8b --kv-cache-dtype fp8_e4m3 --num-continuous-decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
