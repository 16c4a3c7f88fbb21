# fp8 decode settings (short sweep) and repeat offline runs with continuous decode
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 200; cd $OUT && tar czf r_partial.tgz r) & WD=$!
timeout 60 python3 -m benchmarks.gpu.attention_bench --decode-sweep qwen3-0.6b:208:822 --kv-dtype fp8_e4m3 --decode-grid 64,128,256:2,4,8:3 --out $R/sweep_qwen_fp8.json > $R/sweep_qwen_fp8.txt 2>&1; echo "sweep rc=$?"; grep '"contiguous": true' $R/sweep_qwen_fp8.txt | head -3 | cut -c100-330
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b --num-continuous-decode-steps 8"
run() { t=$1; shift; timeout 60 python3 $O "$@" > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
run qwen_fp8_k8_2 --kv-cache-dtype fp8_e4m3
run qwen_bf16_k8
kill $WD 2>/dev/null; pkill -f "sleep 200"
cd $OUT && tar czf r.tgz r && rm -rf r
