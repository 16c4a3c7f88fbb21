# round 19 call e: prefill attention with a cached prefix (both kernels read it through req_to_token): 16 prompts, prefix 2,048 + 128 new (the shared-prefix benchmark's shape) and prefix 4,096 + 1,024 new (a chunked prompt's later chunk)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; t0=$(date +%s)
p() { n=$1; shift; timeout 70 python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b,qwen3-0.6b "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s"; cut -c1-200 $R/$n.txt | grep -v "/16/\|/8/\|/4/2\|/4/4" | sed "s/\"tokens\": [0-9]*, //"; }
p prefix2048 --prefix 2048 --extend 128
p prefix4096 --prefix 4096 --extend 1024
cd $OUT && tar czf r.tgz r && rm -rf r
