# round 14 call F: the cost of a speculative step on a weight-bound target: Llama-3-8B shape (dummy weights) with a random EAGLE head of its shape (16,384-token draft vocabulary), batch 1: plain continuous decode against EAGLE chain-3 windows of 8 (accept ~1 with random drafts: only step costs count)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 275; cd $OUT && tar czf r_partial.tgz r) & WD=$!
python3 -m benchmarks.gpu.random_head --dummy-shape llama3-8b --out /tmp/llama_head.safetensors > $R/head.txt 2>&1; tail -1 $R/head.txt
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --dummy-shape llama3-8b --input-len 128 --batch 1 --max-new-tokens 64 --decode-steps 8"
one() { t=$1; shift; s=$(date +%s); timeout 115 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 300)"; }
one llama_chain3_w8_b1 --spec EAGLE --head /tmp/llama_head.safetensors
one llama_plain_c8_b1
kill $WD 2>/dev/null; pkill -f "sleep 275"
cd $OUT && tar czf r.tgz r && rm -rf r
