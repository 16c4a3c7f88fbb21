# round 14 call E (right after D, the model in /root/mp): repeat at batch 1 with EAGLE single steps and trees; step profiles with real weights (plain c8, chain-3 windows), multiply-add path off
export PYTHONPATH=$HOME/site:$PYTHONPATH; source benchmarks/gpu/setup_h200.sh install >/dev/null
R=$OUT/r; mkdir -p $R; export PHLOEM_SKINNY_FMA_MAX_ROWS=1; M=/root/mp/SmolLM2-135M-Instruct.Q4_1.gguf
s=$(date +%s); timeout 200 python3 benchmarks/gpu/spec_engine.py --model $M --configs plain,plain-c8,eagle-default,eagle-default-w8,eagle-tree-8,eagle-tree-16 --batch-sizes 1 --max-new-tokens 96 --out $R/spec_engine_b1.json > $R/spec_engine_b1.txt 2>&1; echo "spec_engine rc=$? $(( $(date +%s) - s ))s"; grep "tok/s" $R/spec_engine_b1.txt | tail -8
SP="python3 benchmarks/gpu/step_profile.py --model $M --no-torch-profile --max-new-tokens 256"
one() { t=$1; shift; s=$(date +%s); timeout 40 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 260)"; }
one real_plain_c8_b1 --batch 1 --decode-steps 8
one real_chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8
one real_chain4_w8_b1 --batch 1 --spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5 --decode-steps 8
cd $OUT && tar czf r.tgz r && rm -rf r
