# round 14 call D (right after C): the model's last part; the default model with real weights through the Engine (spec_engine.py): plain, plain continuous decode, EAGLE chain-3 and chain-4 windows at batch 1, 8, 32, with the multiply-add path off (PHLOEM_SKINNY_FMA_MAX_ROWS=1: the few-row kernels of 5e2e42c, as committed after the revert). The script was changed to this just before it ran, after call C; the output files keep the names of its first version (spec_engine_fma.*)
mkdir -p /root/mp && cp .mpc/p3 /root/mp/ && cat /root/mp/p1 /root/mp/p2 /root/mp/p3 > /root/mp/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /root/mp/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
M=/root/mp/SmolLM2-135M-Instruct.Q4_1.gguf
s=$(date +%s); PHLOEM_SKINNY_FMA_MAX_ROWS=1 timeout 400 python3 benchmarks/gpu/spec_engine.py --model $M --configs plain,plain-c8,eagle-default-w8,eagle-chain-4-w8 --batch-sizes 1,8,32 --max-new-tokens 96 --out $R/spec_engine_fma.json > $R/spec_engine_fma.txt 2>&1; echo "spec_engine fma rc=$? $(( $(date +%s) - s ))s"; grep "tok/s" $R/spec_engine_fma.txt | tail -15
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
