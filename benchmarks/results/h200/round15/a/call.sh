# round 15 call a: projection GEMMs against row count (cuBLAS, cuBLASLt, Triton TMA tiles);
# Llama-3-8B offline with continuous decode, mixed prefill/decode passes off and on (alternating)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
nvidia-smi > $R/smi.txt 2>&1
timeout 150 python3 benchmarks/gpu/gemm_rows.py --shape llama3-8b --rows 16:256:16 --out $R/rows_llama.json > $R/rows_llama.txt 2>&1; echo "rows llama rc=$?"
timeout 90 python3 benchmarks/gpu/gemm_rows.py --shape qwen3-0.6b --rows 16:256:16 --out $R/rows_qwen.json > $R/rows_qwen.txt 2>&1; echo "rows qwen rc=$?"
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-60} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/$t.txt | tr -s ' ')"; }
T=100 run llama_k8_1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
T=100 run llama_mix_k8_1 --dummy-shape llama3-8b --num-continuous-decode-steps 8 --enable-mixed-chunk
T=100 run llama_k8_2 --dummy-shape llama3-8b --num-continuous-decode-steps 8
T=100 run llama_mix_k8_2 --dummy-shape llama3-8b --num-continuous-decode-steps 8 --enable-mixed-chunk
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
