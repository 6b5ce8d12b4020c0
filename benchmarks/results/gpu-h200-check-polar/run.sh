export PYTHONPATH=$PWD:$PWD/.gpusite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_projection.py tests/test_polar.py -k cuda 2>&1 | tail -4 | tee $OUT/pytest.log
start=$(date +%s)
timeout 200 python3 benchmarks/gpu_check.py --output $OUT/gpu-check.json 2>&1 | tee $OUT/gpu-check.log
echo "gpu_check wall $(( $(date +%s) - start )) s" | tee -a $OUT/gpu-check.log
timeout 110 python3 -m logra_optim.cli bench --preset qwen2.5-1.5b --layers 8 --batch 2 --seq 1024 --rank 256 --accumulation 4 --kl-budget 2e-4 --methods adamw,logra-orthogonal --rounds 1 --runs 3 --warmup 1 --device cuda --detail --output $OUT/bench 2>&1 | tail -12 | tee $OUT/bench.log
