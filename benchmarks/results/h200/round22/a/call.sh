# round 22 call a: cuBLASLt candidate algorithms on Llama-3-8B projections (gemm_algos, first run); Qwen3-0.6B offline with the new decode tile against the old, alternating; the decode kernel GPU tests on the final rule with the time left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 580; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,clocks.max.sm --format=csv > $R/smi.txt 2>&1
timeout 170 python3 -m benchmarks.gpu.gemm_algos --shape llama3-8b --rows 64,128,160,208,240,256 --out $R/algos.json > $R/algos.txt 2>&1; echo "algos rc=$? $(( $(date +%s) - t0 ))s"; grep -v Warning $R/algos.txt | tail -30
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b"
F=runtime/attention/triton_kernels.py; cp $F /tmp/new.py
old() { sed -i 's/^_WIDE_TILE = (128, 4, 2)/_WIDE_TILE = (64, 2, 3)/; s/^_MIN_SPLITS_FULL = 2/_MIN_SPLITS_FULL = 3/' $F; grep -c "^_WIDE_TILE = (64, 2, 3)\|^_MIN_SPLITS_FULL = 3" $F; }
q() { n=$1; left=$(( 470 - $(date +%s) + t0 )); [ $left -lt 50 ] && { echo "$n skipped ($left s left)"; return; }; timeout $(( left < 100 ? left : 100 )) python3 $O --output-file $R/$n.jsonl > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|duration' $R/$n.txt | tr -s ' ' | tr '\n' ';')"; }
q qnew1
old; q qold1
cp /tmp/new.py $F; q qnew2
old; q qold2
cp /tmp/new.py $F
left=$(( 575 - $(date +%s) + t0 ))
[ $left -gt 30 ] && { PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py tests/kernels/test_triton_fp8.py -k "decode or draft" > $R/decode_kernels.txt 2>&1; echo "decode tests rc=$? $(tail -1 $R/decode_kernels.txt)"; }
kill $WD 2>/dev/null; pkill -f "sleep 580"
cd $OUT && tar czf r.tgz r && rm -rf r
