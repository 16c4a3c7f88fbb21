# round 17 call c: offline runs on the new merge kernel: Llama-3-8B (K = 8) with cuBLAS then cuBLASLt, then Qwen3-0.6B
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 490; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; e=$3; shift 3; timeout $lim env $e python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
off llama_blas 150 X=1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
off llama_lt 130 TORCH_BLAS_PREFER_CUBLASLT=1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
off qwen $(( 495 - $(date +%s) + t0 )) X=1 --dummy-shape qwen3-0.6b
kill $WD 2>/dev/null; pkill -f "sleep 490"
cd $OUT && tar czf r.tgz r && rm -rf r
