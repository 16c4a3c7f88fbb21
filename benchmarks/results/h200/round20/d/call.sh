# round 20 call d: the no-sync forward test on the final code and, as a check that it detects the drain, on the old pageable index copy (restored by sed; expected to fail); the HTTP server's GPU tests
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m3 "^FAILED\|^E  " $R/$n.txt | cut -c1-250; }
t nosync_new 60 tests/kernels/test_forward_no_sync.py
F=runtime/executor/model_runner.py; cp $F /tmp/new.py
sed -i 's/hidden\[to_device(plan.rows, hidden.device)\]/hidden[plan.rows.to(hidden.device)]/' $F
t nosync_old 60 tests/kernels/test_forward_no_sync.py
cp /tmp/new.py $F
t server 90 tests/integration/test_server_cuda.py
cd $OUT && tar czf r.tgz r && rm -rf r
