# Device call 1: environment, the CUDA unit tests, the GPU check (issue 15 item 6).
export PYTHONPATH=$PWD:$PWD/.gpusite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep "Model name";
  python3 -c "import sys,torch,transformers,peft,apollo_torch,bitsandbytes;print(sys.version.split()[0],'torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__,'bitsandbytes',bitsandbytes.__version__)"; } 2>&1 | tee $OUT/env.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_projection.py -k cuda 2>&1 | tail -5 | tee $OUT/pytest.log
start=$(date +%s)
timeout 330 python3 benchmarks/gpu_check.py --output $OUT/gpu-check.json 2>&1 | tee $OUT/gpu-check.log
echo "gpu_check wall $(( $(date +%s) - start )) s" | tee -a $OUT/gpu-check.log
