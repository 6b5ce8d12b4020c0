export PYTHONPATH=$PWD:$PWD/.gpusite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "code: 2e26c7a" | tee $OUT/verify.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_polar.py tests/test_projection.py 2>&1 | tail -3 | tee -a $OUT/verify.log
timeout 60 python3 -c "
import sys, json; sys.path.insert(0, 'benchmarks'); import gpu_check
r = {'directions': gpu_check.check_directions('cuda', False), 'bf16 autocast': gpu_check.check_bf16_autocast('cuda', False)}
print(json.dumps(r, indent=1)); json.dump(r, open('$OUT/verify.json', 'w'), indent=1)
" 2>&1 | grep -v Warning | tee -a $OUT/verify.log
