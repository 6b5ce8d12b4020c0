# Device call 2: logra bench at a Qwen2.5-1.5B shape (8 layers), 4 microbatches of 2 x 1024 tokens, KL probe.
export PYTHONPATH=$PWD:$PWD/.gpusite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
timeout 270 python3 -m logra_optim.cli bench --preset qwen2.5-1.5b --layers 8 --batch 2 --seq 1024 --rank 256 --accumulation 4 --kl-budget 2e-4 --methods adamw,frozen,apollo-mini,lora,logra-orthogonal --rounds 1 --runs 3 --warmup 1 --device cuda --detail --output $OUT/bench 2>&1 | tee $OUT/bench.log
echo "bench wall $(( $(date +%s) - start )) s" | tee -a $OUT/bench.log
