# round 17 call a: fused split merge (PHLOEM_DECODE_MERGE) and cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT) A/B at a Llama-3-8B / Qwen3-0.6B decode step of 208 x 822, kernel alone
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --batch 208 --input-len 822 --max-new-tokens 64 --decode-steps 8 --no-torch-profile"
one() { t=$1; shape=$2; lim=$3; shift 3; timeout $lim env "$@" python3 $SP --dummy-shape $shape --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json;print(round(json.load(open('$R/$t.json'))['timing']['tok_s']))" 2>&1 | tail -1)"; }
one l_sep1 llama3-8b 150 PHLOEM_DECODE_MERGE=separate
one l_fus1 llama3-8b 80 PHLOEM_DECODE_MERGE=auto
one l_lt1 llama3-8b 80 PHLOEM_DECODE_MERGE=auto TORCH_BLAS_PREFER_CUBLASLT=1
one l_sep2 llama3-8b 80 PHLOEM_DECODE_MERGE=separate
one l_fus2 llama3-8b 80 PHLOEM_DECODE_MERGE=auto
one l_lt2 llama3-8b 80 PHLOEM_DECODE_MERGE=auto TORCH_BLAS_PREFER_CUBLASLT=1
one q_sep1 qwen3-0.6b 80 PHLOEM_DECODE_MERGE=separate
one q_fus1 qwen3-0.6b 80 PHLOEM_DECODE_MERGE=auto
one q_sep2 qwen3-0.6b 80 PHLOEM_DECODE_MERGE=separate
one q_fus2 qwen3-0.6b 80 PHLOEM_DECODE_MERGE=auto
timeout 60 python3 -m benchmarks.gpu.attention_bench --variant-ab merge:llama3-8b:208:822 --out $R/merge_llama.json > $R/merge_llama.txt 2>&1; echo "merge-ab rc=$? $(( $(date +%s) - t0 ))s"
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
