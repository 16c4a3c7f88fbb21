# round 13 call D2: the model's second part
mkdir -p /root/mp && cp .mpb/p2 /root/mp/ && echo "part2 stored $(du -sb /root/mp)"
# round 13 call D3: the model's last part; the default model with real weights: speculative decoding through the Engine (plain, plain continuous decode, EAGLE single steps and windows), then step times of the windows with real acceptance.
mkdir -p /root/mp && cp .mpc/p3 /root/mp/ && cat /root/mp/p1 /root/mp/p2 /root/mp/p3 > /root/mp/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /root/mp/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
M=/root/mp/SmolLM2-135M-Instruct.Q4_1.gguf
s=$(date +%s); timeout 420 python3 benchmarks/gpu/spec_engine.py --model $M --configs plain,plain-c8,eagle-default,eagle-default-w8,eagle-chain-4-w8,eagle-chain-2-w8 --batch-sizes 1,8,32 --max-new-tokens 96 --out $R/spec_engine.json > $R/spec_engine.txt 2>&1; echo "spec_engine rc=$? $(( $(date +%s) - s ))s"; grep "tok/s" $R/spec_engine.txt
SP="python3 benchmarks/gpu/step_profile.py --model $M --no-torch-profile --max-new-tokens 128"
one() { t=$1; shift; s=$(date +%s); timeout 60 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | head -c 330)"; }
one real_plain_c8_b1 --batch 1 --decode-steps 8
one real_chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
