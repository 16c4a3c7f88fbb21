# round 21 call a: the decode split kernel with 1, 2, 4, 8 KV heads a program (kernel alone); the GPU tests of the decode variants, the (64, 64) extend tiles and the no-sync forward with logprobs; the shared-prefix benchmark with the per-pass extend tiles against 32/32 everywhere
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
h() { n=$1; s=$2; shift 2; timeout $s python3 -m benchmarks.gpu.attention_bench --heads-ab "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s"; grep -v "^{" $R/$n.txt | tail -3 | cut -c1-300; grep "^{" $R/$n.txt | cut -c1-330 | sed 's/"kind": "decode-heads", "shape": "llama3-8b", //'; }
h heads208 170 llama3-8b:208:822
h heads96 60 llama3-8b:96:1200
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m5 "^FAILED\|^ERROR" $R/$n.txt | cut -c1-250; }
t nosync 60 tests/kernels/test_forward_no_sync.py
t attn 150 tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py
SP="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dummy-shape qwen3-0.6b --dataset shared-prefix --num-groups 4 --prompts-per-group 16 --prefix-len 2048 --question-len 128 --output-len 256 --max-concurrency 16 --disable-tqdm"
sp() { n=$1; shift; timeout $(( 570 - $(date +%s) + t0 )) python3 $SP --output-file $R/$n.jsonl "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft\|hit rate' $R/$n.txt | tr -s ' ' | tr '\n' ';')"; }
F=runtime/attention/triton_extend_contig.py; cp $F /tmp/f.py
sp prefix_tiles
sed -i 's/^WIDE_TILE_MIN_RATIO = 4/WIDE_TILE_MIN_RATIO = 10**9/' $F
sp prefix_32
cp /tmp/f.py $F
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
