# round 24 call b: where a Llama-3-8B batch-1 decode step's time goes on the current code (torch profiler, PDL off, then on)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 380; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
left() { echo $(( $1 - $(date +%s) + t0 )); }
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 32"
PHLOEM_PDL=0 timeout 200 python3 $P --out $R/llama_b1_nopdl_prof.json > $R/llama_b1_nopdl_prof.txt 2>&1; echo "nopdl rc=$? $(( $(date +%s) - t0 ))s"
L=$(left 370); [ $L -gt 40 ] && { timeout $L python3 $P --out $R/llama_b1_pdl_prof.json > $R/llama_b1_pdl_prof.txt 2>&1; echo "pdl rc=$? $(( $(date +%s) - t0 ))s"; }
kill $WD 2>/dev/null; pkill -f "sleep 380"
cd $OUT && tar czf r.tgz r && rm -rf r
