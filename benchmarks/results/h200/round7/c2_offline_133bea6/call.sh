# offline throughput with and without continuous decode (dummy weights; 256 sequences, lengths uniform in [102, 1024])
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
O="python3 -m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { name=$1; shift; timeout ${T:-100} $O "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $(grep -i 'output token throughput' $R/$name.txt | head -1 | tr -s ' ')"; }
run qwen_k1_cold --dummy-shape qwen3-0.6b
for k in 8 1 8; do run qwen_k${k}_$RANDOM --dummy-shape qwen3-0.6b --num-continuous-decode-steps $k; done
T=150 run llama_k1 --dummy-shape llama3-8b
T=150 run llama_k8 --dummy-shape llama3-8b --num-continuous-decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
