# round 21 call d: the ragged decode sweep on Qwen3-0.6B heads; Llama-3-8B offline with the new decode tile (128 keys, 4 warps, 2 stages; two splits from 1,024 pairs) against the old (64, 2, 3; three splits), alternating new, old, new, old (the old restored by sed)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 585; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
timeout 60 python3 -m benchmarks.gpu.attention_bench --ragged-sweep qwen3-0.6b:128,208,256 --out $R/ragged_qwen.json > $R/ragged_qwen.txt 2>&1; echo "ragged_qwen rc=$? $(( $(date +%s) - t0 ))s"; grep -v Warning $R/ragged_qwen.txt | head -24
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b"
F=runtime/attention/triton_kernels.py; cp $F /tmp/new.py
old() { sed -i 's/^_WIDE_TILE = (128, 4, 2)/_WIDE_TILE = (64, 2, 3)/; s/^_MIN_SPLITS_FULL = 2/_MIN_SPLITS_FULL = 3/' $F; grep -c "^_WIDE_TILE = (64, 2, 3)\|^_MIN_SPLITS_FULL = 3" $F; }
l() { n=$1; left=$(( 580 - $(date +%s) + t0 )); [ $left -lt 100 ] && { echo "$n skipped ($left s left)"; return; }; timeout $(( left < 125 ? left : 125 )) python3 $O --output-file $R/$n.jsonl > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|duration' $R/$n.txt | tr -s ' ' | tr '\n' ';')"; }
l new1
old; l old1
cp /tmp/new.py $F; l new2
old; l old2
cp /tmp/new.py $F
kill $WD 2>/dev/null; pkill -f "sleep 585"
cd $OUT && tar czf r.tgz r && rm -rf r
