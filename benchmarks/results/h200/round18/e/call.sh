# round 18 call e: the TMA extend-attention probe (benchmarks/gpu/extend_tma_probe.py), Llama-3-8B heads
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
timeout 100 python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b --out $R/probe.json > $R/probe.txt 2>&1; echo "probe rc=$?"
cat $R/probe.txt | cut -c1-400 | tail -25
cd $OUT && tar czf r.tgz r && rm -rf r
