# round 18 call d: Llama-3-8B offline at the default continuous decode (auto) against K = 8, alternating
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 470; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
off auto1 170
off k8 130 --num-continuous-decode-steps 8
off auto2 $(( 460 - $(date +%s) + t0 ))
kill $WD 2>/dev/null; pkill -f "sleep 470"
cd $OUT && tar czf r.tgz r && rm -rf r
