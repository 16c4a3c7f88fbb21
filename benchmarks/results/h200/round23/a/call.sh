# round 23 call a: continuous decode as graph replays back to back (ModelRunner.forward_steps): GPU tests of the decode path, then SmolLM2 batch 1 and 64 alternating with the per-step forward path (the worker's fast path switched off by sed), Triton argmax in that path, a torch-profiled window
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $R/smi.txt 2>&1
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok"
st() { t=$1; lim=$2; shift 2; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"worker_cpu_ms_mean": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -3 | tr '\n' ' ')"; }
W=runtime/executor/worker.py; cp $W /tmp/worker_new.py
old() { sed -i 's/by_graph = getattr(self.runner, "forward_steps", None)/by_graph = None/' $W; grep -c "by_graph = None" $W; }
new() { cp /tmp/worker_new.py $W; }
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 200 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py -k "continuous or sampled" > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"
B1="--no-torch-profile --batch 1 --input-len 128 --max-new-tokens 256"
B64="--no-torch-profile --batch 64 --input-len 128 --max-new-tokens 256"
new; st b1_new_1 45 $B1
old; st b1_old_1 45 $B1
new; st b1_new_2 45 $B1
old; st b1_old_2 45 $B1
new; st b64_new_1 45 $B64
old; st b64_old_1 45 $B64
new; st b64_new_2 45 $B64
new; st b1_new_16 45 $B1 --decode-steps 16
S=runtime/sampling/sampler.py; cp $S /tmp/sampler.py; sed -i 's/^TRITON_ARGMAX_MIN_VOCAB = 65536/TRITON_ARGMAX_MIN_VOCAB = 0/' $S; grep -c "MIN_VOCAB = 0" $S
st b1_new_tritonargmax $(( 560 - $(date +%s) + t0 < 45 ? 560 - $(date +%s) + t0 : 45 )) $B1
cp /tmp/sampler.py $S
st b1_new_prof $(( 570 - $(date +%s) + t0 < 60 ? 570 - $(date +%s) + t0 : 60 )) --batch 1 --input-len 128 --max-new-tokens 256
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
