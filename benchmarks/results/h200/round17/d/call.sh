# round 17 call d: Llama-3-8B offline (K = 8) repeated, cuBLASLt then cuBLAS
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 260; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; e=$3; shift 3; timeout $lim env $e python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
off llama_lt2 120 TORCH_BLAS_PREFER_CUBLASLT=1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
# X=1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
off llama_blas2 120 X=1 --dummy-shape llama3-8b --num-continuous-decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 260"
cd $OUT && tar czf r.tgz r && rm -rf r
