# round 21 call b: the shared-prefix benchmark's slow first waves: a fresh Triton cache, then the per-pass extend tiles (run twice) and 32/32 everywhere (twice), with per-pass logs and the kernels compiled during each run (cache entries by time)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export TRITON_CACHE_DIR=$HOME/tc_fresh; rm -rf $TRITON_CACHE_DIR
t0=$(date +%s)
SP="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dummy-shape qwen3-0.6b --dataset shared-prefix --num-groups 4 --prompts-per-group 16 --prefix-len 2048 --question-len 128 --output-len 256 --max-concurrency 16 --disable-tqdm --log-level info --log-interval 1"
sp() { n=$1; shift; date +%s.%N > $R/$n.start; timeout 120 python3 $SP --output-file $R/$n.jsonl "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|p90 ttft\|hit rate' $R/$n.txt | tr -s ' ' | tr '\n' ';')"; find $TRITON_CACHE_DIR -name "*.json" ! -name "__grp__*" -newer $R/$n.start -printf "%T@ %f\n" | sort > $R/$n.compiled; wc -l < $R/$n.compiled; }
F=runtime/attention/triton_extend_contig.py; cp $F /tmp/f.py
sp tiles1
sp tiles2
sed -i 's/^WIDE_TILE_MIN_RATIO = 4/WIDE_TILE_MIN_RATIO = 10**9/' $F
sp w32_1
sp w32_2
cp /tmp/f.py $F
rm -rf $HOME/tc_fresh2; export TRITON_CACHE_DIR=$HOME/tc_fresh2
sed -i 's/^WIDE_TILE_MIN_RATIO = 4/WIDE_TILE_MIN_RATIO = 10**9/' $F
sp w32_fresh
cp /tmp/f.py $F
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
