# round 5, call 4: both threads' CPU per step and their cProfiles (HEAD); A/B 78be311 vs HEAD at b64
R=$OUT/r; mkdir -p $R; (sleep 300; cd $OUT && tar czf r_partial.tgz r) & WD=$!
cd .snap && rm -rf .whl && cp -r ../.whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
ln -sf ../.gputok .gputok; cd ..; ln -sf ../.gputok .snapbase/.gputok
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
run() { d=$1; t=$2; shift 2; (cd $d && GIT_COMMIT=$(cat COMMIT) timeout 60 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_cpu_ms_mean": [0-9.]*' $R/$t.json | head -1) $(grep -o '"worker_cpu_ms_mean": [0-9.]*' $R/$t.json | head -1)"; }
run .snap smol_b1_cprof --batch 1 --max-new-tokens 256 --cprofile
run .snap smol_b64_cprof --batch 64 --max-new-tokens 256 --input-len 128 --cprofile
for i in 1 2 3; do
  run .snapbase smol_b64_base$i --batch 64 --max-new-tokens 256 --input-len 128
  run .snap smol_b64_new$i --batch 64 --max-new-tokens 256 --input-len 128
done
kill $WD 2>/dev/null; pkill -f "sleep 300" 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
