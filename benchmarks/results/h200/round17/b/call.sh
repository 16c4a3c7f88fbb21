# round 17 call b: the merge kernel by KV head (new) against one program per query head (old, .gp1 = triton_kernels.py of 406d771): GPU kernel tests, kernel alone, Llama-3-8B decode step at 208 x 822, alternating
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
K=runtime/attention/triton_kernels.py; cp $K .gpnew
use() { if [ $1 = old ]; then cp .gp1 $K; else cp .gpnew $K; fi; }
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -2 $R/tests.txt
for v in new old; do use $v; timeout 50 python3 -m benchmarks.gpu.attention_bench --order-ab llama3-8b:208:822 --out $R/kernel_$v.json > $R/kernel_$v.txt 2>&1; echo "kernel $v rc=$? $(( $(date +%s) - t0 ))s"; done
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --batch 208 --input-len 822 --max-new-tokens 64 --decode-steps 8 --no-torch-profile --dummy-shape llama3-8b"
for t in new1 old1 new2 old2; do use ${t%?}; timeout 85 python3 $SP --out $R/l_$t.json > $R/l_$t.txt 2>&1; echo "l_$t rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json;print(round(json.load(open('$R/l_$t.json'))['timing']['tok_s']))" 2>&1 | tail -1)"; done
use new
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
