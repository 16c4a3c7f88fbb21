# round 11 call 4: prefill chunk of 16,384 against 8,192 tokens (offline, alternating)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 440; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-60} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/$t.txt | tr -s ' ')"; }
run qwen_c8k_1 --dummy-shape qwen3-0.6b --chunked-prefill-size 8192
run qwen_c16k_1 --dummy-shape qwen3-0.6b --chunked-prefill-size 16384
run qwen_c8k_2 --dummy-shape qwen3-0.6b --chunked-prefill-size 8192
run qwen_c16k_2 --dummy-shape qwen3-0.6b --chunked-prefill-size 16384
run qwen_c16k_k8 --dummy-shape qwen3-0.6b --chunked-prefill-size 16384 --num-continuous-decode-steps 8
T=100 run llama_c16k_k8 --dummy-shape llama3-8b --chunked-prefill-size 16384 --num-continuous-decode-steps 8
T=100 run llama_c8k_k8 --dummy-shape llama3-8b --chunked-prefill-size 8192 --num-continuous-decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 440"
cd $OUT && tar czf r.tgz r && rm -rf r
