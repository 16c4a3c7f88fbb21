# round 14 call B: few-row matmuls by per-row multiply-adds (2-8 rows, the one-row reduction per row). GPU kernel tests (skinny, row-fused, draft attention); skinny_bench and row_fused_bench at 2, 4, 5, 8 rows with the multiply-add path on (default) and off (PHLOEM_SKINNY_FMA_MAX_ROWS=1: the tl.dot path as before). Stores the model's first part.
mkdir -p /root/mp && cp .mpa/p1 /root/mp/ && echo "part1 stored $(du -sb /root/mp)"
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 400; cd $OUT && tar czf r_partial.tgz r) & WD=$!
s=$(date +%s); timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_row_fused.py tests/kernels/test_draft_attention.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"; grep -m5 "FAIL\|Error" $R/tests.txt | head -c 1500
b() { t=$1; shift; s=$(date +%s); timeout 100 "$@" > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s"; }
b skinny_fma python3 -m benchmarks.gpu.skinny_bench --rows 2,4,5,8 --out $R/skinny_fma.json
PHLOEM_SKINNY_FMA_MAX_ROWS=1 b skinny_dot python3 -m benchmarks.gpu.skinny_bench --rows 2,4,5,8 --out $R/skinny_dot.json
b rowfused_fma python3 -m benchmarks.gpu.row_fused_bench --rows 2,4,5,8 --out $R/rowfused_fma.json
PHLOEM_SKINNY_FMA_MAX_ROWS=1 b rowfused_dot python3 -m benchmarks.gpu.row_fused_bench --rows 2,4,5,8 --out $R/rowfused_dot.json
kill $WD 2>/dev/null; pkill -f "sleep 400"
cd $OUT && tar czf r.tgz r && rm -rf r
